"""A sharded train step equals the single-device step (issue acceptance 1), on 8 fake CPU devices.

Each mesh: loss and every gradient of one step within 1e-5 (relative, 2-norm per array) of the
single-device step, the loss curve and all parameters after 3 steps likewise, and the state keeps
the shardings the rules give it. On the pipeline meshes the MoE layers run in stages under the GPipe
schedule of sharding/pipeline.py (the step's HLO hands activations on with collective_permute),
with 4 MoE layers (even stages) and 3 on 2 stages under the circular schedule (uneven chunks);
the 1F1B and DualPipeV schedules, whose backward runs by hand, with 6 MoE layers on 4 stages.
"""

import pytest

from tests.sharding import workers

TOL = 1e-5


def run_worker(*args):
    rows = workers.run_worker("tests.sharding.parity_worker", *args, timeout=1500)
    assert [r["mesh"] for r in rows] == [a for a in args if not a.startswith("--")]
    return rows


def check(row):
    assert row["loss_rel"] < TOL, row
    assert row["grad_rel"] < TOL, row
    assert row["params_rel"] < TOL, row
    assert row["bias_rel"] < TOL, row
    assert row["curve"] == pytest.approx(row["ref_curve"], rel=TOL)
    assert row["shardings_kept"], row
    assert row["moments_over_data"] == ("data=" in row["mesh"]), row  # ZeRO-1, the loss as on one device


def test_data_fsdp_expert_tensor_meshes_match_one_device():
    # plain data parallelism is the `data` axis of data=2,expert=4 (and of the pipeline meshes)
    for row in run_worker("fsdp=8", "data=2,expert=4", "fsdp=2,tensor=2,expert=2"):
        check(row)
        assert not row["stage_handoff"], row
        assert row["expert_all_to_all"] == ("expert" in row["mesh"]), row


def test_pipeline_meshes_match_one_device():
    rows = run_worker("pipeline=2,expert=2,data=2", "pipeline=4,data=2")
    # 3 MoE layers, circular schedule: 2 stages x 2 rounds = 4 chunks of 1, one of them empty
    rows += run_worker("--num_layers=4", "--pipeline_repeats=2", "pipeline=2,data=4")
    assert [r["moe_layers"] for r in rows] == [4, 4, 3]
    for row in rows:
        check(row)
        assert row["stage_handoff"], row
        assert row["expert_all_to_all"] == ("expert" in row["mesh"]), row


def test_hand_run_backward_schedules_match_one_device():
    # 6 MoE layers on 4 stages: 1F1B splits them 2, 2, 1, 1 and DualPipeV's V of 8 chunks holds two
    # empty ones, so both run padding slots; even splits are held in tests/sharding/test_pipeline.py.
    rows = run_worker("--num_layers=7", "pipeline=4,data=2:1f1b", "pipeline=4,data=2:dualpipev")
    assert [r["moe_layers"] for r in rows] == [6, 6]
    for row in rows:
        check(row)
        assert row["stage_handoff"], row

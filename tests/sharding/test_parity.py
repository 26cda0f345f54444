"""A sharded train step equals the single-device step (issue acceptance 1), on 8 fake CPU devices.

Each mesh: the loss and every gradient of the train step's first step (read from AdamW's first
moment) within 1e-5 (relative, 2-norm per array) of the single-device step, the loss curve and all
parameters after 3 steps likewise, and the state keeps the shardings the rules give it. On the
pipeline meshes the MoE layers (6 of them) run in stages under each schedule of sharding/pipeline.py
(the model's lowered loss and gradients hand activations on with collective_permute): GPipe on
even and uneven stages, circular with empty chunks, and the 1F1B and DualPipeV schedules, whose
backward runs by hand, with padding slots.
"""

import pytest

from tests.sharding import workers

TOL = 1e-5


def run_worker(*args, timeout: int = 1500):
    rows = workers.run_worker("tests.sharding.parity_worker", *args, timeout=timeout)
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


def test_pipeline_schedules_match_one_device():
    # One worker, one single-device reference: 6 MoE layers. GPipe on pipeline=2 (3 + 3: the stored
    # layout) with expert=2, and on pipeline=4 (2, 2, 1, 1: padding slots); circular on pipeline=4 x
    # 2 rounds = 8 chunks of 1, two of them empty; 1F1B (2, 2, 1, 1) and DualPipeV (a V of 8 chunks,
    # two empty), whose backwards run by hand. Even splits of those two: tests/sharding/test_pipeline.py.
    meshes = ["pipeline=2,expert=2,data=2", "pipeline=4,data=2", "pipeline=4,data=2:circular",
              "pipeline=4,data=2:1f1b", "pipeline=4,data=2:dualpipev"]
    rows = run_worker("--num_layers=7", *meshes, timeout=3000)  # the work of the two workers it replaces
    assert [r["moe_layers"] for r in rows] == [6] * len(meshes)
    for row in rows:
        check(row)
        assert row["stage_handoff"], row
        assert row["expert_all_to_all"] == ("expert" in row["mesh"]), row

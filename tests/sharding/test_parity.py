"""A sharded train step equals the single-device step (issue acceptance 1), on 8 fake CPU devices.

Each mesh: loss and every gradient of one step within 1e-5 (relative, 2-norm per array) of the
single-device step, the loss curve and all parameters after 3 steps likewise, and the state keeps
the shardings the rules give it. The pipeline meshes here shard the stacked layers on `pipeline`
and let XLA partition the scan (no stage schedule: see sharding/pipeline.py for that).
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5


def run_worker(*meshes):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-m", "tests.sharding.parity_worker", *meshes], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["mesh"] for r in rows] == list(meshes)
    return rows


def check(row):
    assert row["loss_rel"] < TOL, row
    assert row["grad_rel"] < TOL, row
    assert row["params_rel"] < TOL, row
    assert row["bias_rel"] < TOL, row
    assert row["curve"] == pytest.approx(row["ref_curve"], rel=TOL)
    assert row["shardings_kept"], row


def test_data_fsdp_expert_tensor_meshes_match_one_device():
    for row in run_worker("data=8", "fsdp=8", "data=2,expert=4", "fsdp=2,tensor=2,expert=2"):
        check(row)


def test_layers_on_pipeline_meshes_match_one_device():
    for row in run_worker("pipeline=2,expert=2,data=2", "pipeline=4,data=2"):
        check(row)

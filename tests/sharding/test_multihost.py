"""Two processes (jax.distributed on 127.0.0.1, 4 fake CPU devices each) train like one process
with 8 devices (issue acceptance 3)."""

import json
import subprocess
import sys

import pytest

from sharding import multihost
from tests.helpers import REPO, fake_device_env, free_port, without_cluster


def _env():
    return without_cluster(fake_device_env())


def _result(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def test_single_process_needs_no_initialize(monkeypatch):
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
                "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(key, raising=False)
    assert multihost.initialize() is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert multihost.initialize() is False


def test_two_processes_match_one_process_with_eight_devices():
    # The pair and the single 8-device process run side by side (one start-up's wait, not two).
    port = free_port()
    cmd = [sys.executable, "-m", "tests.sharding.multihost_worker"]
    procs = [subprocess.Popen(cmd + args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for args in ([str(port), "2", "0"], [str(port), "2", "1"], ["0", "1", "0"])]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    two, one = _result(outs[0][0]), _result(outs[2][0])
    assert two["processes"] == 2 and one["processes"] == 1
    assert len(two["curve"]) == 3
    for a, b in zip(two["curve"], one["curve"]):
        assert a == pytest.approx(b, rel=1e-6)
    assert two["param_sq"] == pytest.approx(one["param_sq"], rel=1e-6)

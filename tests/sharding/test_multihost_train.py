"""Two `python -m experiments.train` processes (4 fake CPU devices each, jax.distributed on
127.0.0.1), started with the commands experiments.launch.local gives them, train like one process
with 8 devices, and resume together after both are killed (issue 12, acceptance 6)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import free_port, without_cluster
from experiments.launch import local
from tests.sharding import workers
from tests.sharding.parity_worker import FAST_COMPILE
from tests.sharding.test_train_cli import OVERRIDES

STEPS = 4
MESH = ["--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.expert=4"]
COMMON = [f for f in OVERRIDES if not f.startswith(("--steps", "--config.data.batch_size", "--config.train.checkpoint_every"))]
COMMON += [f"--steps={STEPS}", "--config.train.checkpoint_every=2", *MESH]


def _env(devices: int) -> dict:
    env = workers.fake_device_env(XLA_FLAGS="--xla_cpu_collective_call_terminate_timeout_seconds=900 "
                                  f"--xla_cpu_collective_timeout_seconds=900 "
                                  f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")
    return without_cluster(env)


def _curve(workdir) -> list[tuple[int, float]]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def _start_pair(workdir, logs):
    cmds = local.commands(2, [f"--workdir={workdir}", *COMMON, "--config.data.batch_size=4"], port=free_port())
    assert [c.env["JAX_PROCESS_ID"] for c in cmds] == ["0", "1"]
    return local.start(cmds, _env(4), cwd=workers.REPO, stdout=subprocess.DEVNULL, stderr=logs)


def test_two_processes_train_like_eight_devices_and_resume_after_kill(tmp_path):
    one = tmp_path / "one"
    run = workers.run([sys.executable, "-m", "experiments.train", f"--workdir={one}", *COMMON,
                       "--config.data.batch_size=8"], _env(8), timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    reference = _curve(one)
    assert [s for s, _ in reference] == list(range(1, STEPS + 1))

    two = tmp_path / "two"
    with open(tmp_path / "first.log", "w") as log:
        procs = _start_pair(two, log)
        deadline = time.time() + 900
        while not os.path.isdir(two / "checkpoints" / "2") and time.time() < deadline:
            assert all(p.poll() is None for p in procs), (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.2)
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    assert all(p.returncode == -signal.SIGKILL for p in procs)
    assert max(s for s, _ in _curve(two)) < STEPS, "both processes finished before they were killed"

    with open(tmp_path / "second.log", "w") as log:
        procs = _start_pair(two, log)
        codes = [p.wait(timeout=900) for p in procs]
    text = (tmp_path / "second.log").read_text()
    assert codes == [0, 0], text[-3000:]
    assert "resumed from" in text
    resumed = _curve(two)
    assert [s for s, _ in resumed] == list(range(1, STEPS + 1))
    assert [v for _, v in resumed] == pytest.approx([v for _, v in reference], rel=1e-5)

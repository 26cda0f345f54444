"""Two `python -m experiments.train` processes (4 fake CPU devices each, jax.distributed on
127.0.0.1), started with the commands experiments.launch.local gives them, train like one process
with 8 devices; SIGTERM to one of them, and then to both at different moments, makes both save the
same step and exit 0, and the restart continues the single process's loss curve exactly."""

import json
import os
import re
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

STEPS = 8
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


def _start_pair(workdir, tmp_path, tag):
    cmds = local.commands(2, [f"--workdir={workdir}", *COMMON, "--config.data.batch_size=4"], port=free_port())
    assert [c.env["JAX_PROCESS_ID"] for c in cmds] == ["0", "1"]
    logs = [tmp_path / f"{tag}.{i}.log" for i in range(2)]
    procs = [local.start([c], _env(4), cwd=workers.REPO, stdout=subprocess.DEVNULL, stderr=open(log, "w"))[0]
             for c, log in zip(cmds, logs)]
    return procs, logs


def _wait_for_step(workdir, step, procs, logs):
    deadline = time.time() + 900
    while time.time() < deadline:
        assert all(p.poll() is None for p in procs), "".join(log.read_text()[-2000:] for log in logs)
        if os.path.exists(workdir / "metrics.jsonl") and any(s >= step for s, _ in _curve(workdir)):
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within the deadline")


def _stopped_at(procs, logs) -> int:
    """The step both processes saved and stopped at (each says so in its log), after exit code 0."""
    codes = [p.wait(timeout=900) for p in procs]
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts[0][-2000:] + texts[1][-2000:]
    steps = [re.findall(r"SIGTERM: saved a checkpoint at step (\d+)", t) for t in texts]
    assert len(steps[0]) == 1 and steps[0] == steps[1], steps
    return int(steps[0][0])


def test_two_processes_train_like_eight_devices_stop_together_and_resume(tmp_path):
    one = tmp_path / "one"
    run = workers.run([sys.executable, "-m", "experiments.train", f"--workdir={one}", *COMMON,
                       "--config.data.batch_size=8"], _env(8), timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    reference = _curve(one)
    assert [s for s, _ in reference] == list(range(1, STEPS + 1))

    two = tmp_path / "two"
    procs, logs = _start_pair(two, tmp_path, "first")  # SIGTERM to process 1 only
    _wait_for_step(two, 1, procs, logs)
    procs[1].send_signal(signal.SIGTERM)
    first = _stopped_at(procs, logs)
    assert 1 < first < STEPS and os.path.isdir(two / "checkpoints" / str(first))

    procs, logs = _start_pair(two, tmp_path, "second")  # SIGTERM to both, one after the other
    _wait_for_step(two, first + 1, procs, logs)
    procs[0].send_signal(signal.SIGTERM)
    time.sleep(0.5)
    if procs[1].poll() is None:
        procs[1].send_signal(signal.SIGTERM)
    second = _stopped_at(procs, logs)
    assert "resumed from" in logs[0].read_text() and first < second <= STEPS

    # Steps 1..first were trained by the first pair, first+1..second by the restarted one.
    resumed = _curve(two)
    assert [s for s, _ in resumed] == list(range(1, second + 1))
    assert [v for _, v in resumed] == pytest.approx([v for _, v in reference[:second]], rel=1e-5)

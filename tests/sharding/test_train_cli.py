"""`python -m experiments.train --config.mesh.<axis>=N` on 8 fake CPU devices gives the loss curve
of the single-device run (issue acceptance 1, last clause)."""

import json
import os
import subprocess
import sys

import pytest

from tests.sharding.parity_worker import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
OVERRIDES = [
    "--config.model.hidden_size=32", "--config.model.intermediate_size=64", "--config.model.moe_intermediate_size=16",
    "--config.model.num_layers=3", "--config.model.num_heads=2", "--config.model.q_lora_rank=16",
    "--config.model.kv_lora_rank=16", "--config.model.qk_nope_head_dim=8", "--config.model.qk_rope_head_dim=8",
    "--config.model.v_head_dim=8", "--config.data.seq_len=32", "--config.data.batch_size=8",
    "--config.optimizer.warmup_steps=2", "--config.train.eval_every=0", "--config.train.log_every=1",
    "--config.train.checkpoint_every=100", "--config.train.compilation_cache=", f"--steps={STEPS}",
]


def train_losses(workdir, devices: int, *mesh_flags) -> list[float]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS=f"--xla_cpu_collective_call_terminate_timeout_seconds=900 --xla_cpu_collective_timeout_seconds=900 --xla_force_host_platform_device_count={devices} {FAST_COMPILE}")
    cmd = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *OVERRIDES, *mesh_flags]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records], out.stderr


def test_mesh_overrides_give_the_single_device_loss_curve(tmp_path):
    one, _ = train_losses(tmp_path / "one", 1)
    for name, flags in {"ep": ["--config.mesh.data=2", "--config.mesh.expert=4"],
                        "pp": ["--config.mesh.pipeline=2", "--config.mesh.expert=2", "--config.mesh.data=2"]}.items():
        curve, log = train_losses(tmp_path / name, 8, *flags)
        assert "mesh {" in log and "'expert':" in log
        assert curve == pytest.approx(one, rel=1e-5), (name, curve, one)


def test_mesh_that_does_not_divide_the_batch_is_an_error(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS="--xla_cpu_collective_call_terminate_timeout_seconds=900 --xla_cpu_collective_timeout_seconds=900 --xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", *OVERRIDES,
                          "--config.mesh.data=-1", "--config.data.batch_size=12"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert "data.batch_size=12 is not divisible by data=8" in out.stderr

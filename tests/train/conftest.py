"""Shared pieces for the training tests: a test-sized model and a runner for the train CLI."""

import os
import subprocess
import sys

import pytest

STEPS = 60  # every CLI test trains this long, so they all share one compiled step (the schedule spans it)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tiny preset shrunk further (every feature still on: q LoRA, groups, shared expert, MTP) so a
# subprocess run compiles and trains a few steps in seconds.
TEST_OVERRIDES = [
    "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
    "--config.model.moe_intermediate_size=16", "--config.model.num_layers=2",
    "--config.model.num_heads=2", "--config.model.q_lora_rank=16", "--config.model.kv_lora_rank=16",
    "--config.model.qk_nope_head_dim=8", "--config.model.qk_rope_head_dim=8",
    "--config.model.v_head_dim=8", "--config.data.seq_len=32", "--config.data.batch_size=8",
    "--config.optimizer.warmup_steps=2", "--config.train.eval_batches=1", "--config.train.log_every=1",
    f"--steps={STEPS}",
]


def train_command(workdir, *flags, cache_dir, module="experiments.train"):
    return [sys.executable, "-m", module, f"--workdir={workdir}", f"--config.train.compilation_cache={cache_dir}",
            *TEST_OVERRIDES, *flags]


def run_train(workdir, *flags, cache_dir, check=True, timeout=600, module="experiments.train"):
    cmd = train_command(workdir, *flags, cache_dir=cache_dir, module=module)
    result = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    return result


def train_env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla_cache"))

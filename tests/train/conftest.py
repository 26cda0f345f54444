"""Shared pieces for the training tests: a test-sized model and a runner for the train CLI."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tiny preset shrunk further (every feature still on: q LoRA, groups, shared expert, MTP) so a
# subprocess run compiles and trains a few steps in seconds.
TEST_OVERRIDES = [
    "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
    "--config.model.moe_intermediate_size=16", "--config.model.num_layers=2",
    "--config.model.num_heads=2", "--config.model.q_lora_rank=16", "--config.model.kv_lora_rank=16",
    "--config.model.qk_nope_head_dim=8", "--config.model.qk_rope_head_dim=8",
    "--config.model.v_head_dim=8", "--config.data.seq_len=32", "--config.data.batch_size=4",
    "--config.optimizer.warmup_steps=2", "--config.train.eval_batches=1",
]


def run_train(workdir, *flags, cache_dir, check=True, timeout=600):
    cmd = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}",
           f"--config.train.compilation_cache={cache_dir}", *TEST_OVERRIDES, *flags]
    result = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    return result


def train_env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla_cache"))

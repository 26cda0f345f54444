"""Shared pieces for the training tests: a test-sized model and a runner for the train CLI."""

import json
import os
import sys

import pytest

from tests.helpers import REPO, build_once, repo_env, run, session_root, shrunk_flags  # noqa: F401 (REPO: for the test files)

STEPS = 60  # every CLI test trains this long, so they all share one compiled step (the schedule spans it)

# The shrunk tiny model (tests/helpers.py) so a subprocess run compiles and trains a few steps in seconds.
TEST_OVERRIDES = [
    *shrunk_flags(), "--config.data.seq_len=32", "--config.data.batch_size=8",
    "--config.optimizer.warmup_steps=2", "--config.train.eval_batches=1", "--config.train.log_every=1",
    f"--steps={STEPS}",
]


def train_command(workdir, *flags, cache_dir, module="experiments.train", config=None):
    """`config`: a config file, passed first (absl reads --config before any --config.* override)."""
    first = [f"--config={config}"] if config else []
    return [sys.executable, "-m", module, *first, f"--workdir={workdir}",
            f"--config.train.compilation_cache={cache_dir}", *TEST_OVERRIDES, *flags]


def run_train(workdir, *flags, cache_dir, check=True, timeout=600, module="experiments.train", config=None):
    cmd = train_command(workdir, *flags, cache_dir=cache_dir, module=module, config=config)
    result = run(cmd, train_env(), timeout=timeout)
    if check and result.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    return result


def train_env():
    return repo_env()


def shared_compile_cache(tmp_path_factory) -> str:
    """One persistent compilation cache for the train CLI runs of every worker."""
    folder = session_root(tmp_path_factory) / "xla_cache"
    folder.mkdir(exist_ok=True)
    return str(folder)


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    return shared_compile_cache(tmp_path_factory)


def read_records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


RESUME_FLAGS = ["--config.train.checkpoint_every=2", "--config.train.eval_every=20"]


def pretraining_run(tmp_path_factory):
    """One STEPS-step run of the test-sized model for the whole session (all workers; read only):
    the CLI tests' reference run, the fine-tuning tests' pretrained model and the run the inference
    tests start from (tests/conftest.py `trained_run`). (workdir, metrics records, stderr, stdout)."""
    def build(folder):
        result = run_train(folder / "run", *RESUME_FLAGS, cache_dir=shared_compile_cache(tmp_path_factory))
        (folder / "stderr.txt").write_text(result.stderr)
        (folder / "stdout.txt").write_text(result.stdout)

    folder = build_once(tmp_path_factory, "pretraining_run", build)
    run_dir = folder / "run"
    return run_dir, read_records(run_dir), (folder / "stderr.txt").read_text(), (folder / "stdout.txt").read_text()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The session's pretraining run (`pretraining_run`): (workdir, metrics records, stderr)."""
    return pretraining_run(tmp_path_factory)[:3]


@pytest.fixture(scope="session")
def pretrained(uninterrupted):
    """The folder of that run: the model the fine-tuning CLI tests (SFT, LoRA) start from."""
    return uninterrupted[0]

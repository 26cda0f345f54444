"""dsv3_jax/train/loop.py in-process: no checkpoint is saved while steps are skipped as
non-finite, and a run whose first step after a restore is non-finite stops naming the checkpoint."""

import os

import jax.numpy as jnp
import pytest

from dsv3_jax.train import loop, step as step_lib
from experiments.configs.tiny import get_config
from tests.helpers import SHRUNK


def _config(workdir, cache_dir, steps):
    config = get_config()
    config.model.update(SHRUNK)
    config.data.update(seq_len=32, batch_size=8)
    config.optimizer.warmup_steps = 2
    config.train.update(workdir=str(workdir), steps=steps, checkpoint_every=2, eval_every=0, log_every=1,
                        compilation_cache=cache_dir, max_consecutive_skips=10)
    return config


def _skipping_from(first_bad_step: int, monkeypatch):
    """The train step, with its metrics saying the step was skipped as non-finite from
    `first_bad_step` on (what a NaN loss makes the real step report)."""
    make = step_lib.make_train_step

    def make_skipping(*args, **kwargs):
        train_step = make(*args, **kwargs)

        def skipping(state, batch):
            state, m = train_step(state, batch)
            if int(state.step) >= first_bad_step:
                m = dict(m, consecutive_skips=jnp.int32(int(state.step) - first_bad_step + 1))
            return state, m

        return skipping

    monkeypatch.setattr(step_lib, "make_train_step", make_skipping)


def _saved_steps(workdir):
    return sorted(int(name) for name in os.listdir(workdir / "checkpoints") if name.isdigit())


def test_skipping_steps_save_nothing_and_a_bad_first_step_after_a_restore_stops(tmp_path, compile_cache,
                                                                                 monkeypatch):
    with monkeypatch.context() as patch:
        _skipping_from(3, patch)
        records = loop.train(_config(tmp_path, compile_cache, steps=4))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert _saved_steps(tmp_path) == [2]  # step 4, the last, was skipping: the run ends on the intact step

    _skipping_from(3, monkeypatch)  # the resumed run's first step (3) is non-finite too
    with pytest.raises(loop.TrainingError, match=r"step 3, the first after restoring the checkpoint of step 2.*"
                                                 r"checkpoint of step 2 is suspect"):
        loop.train(_config(tmp_path, compile_cache, steps=6))
    assert _saved_steps(tmp_path) == [2]

"""Exact resume with the full FP8 recipe on (FP8 Fprop/Dgrad/Wgrad, FP8 residuals, bf16 moments)."""

import json
import os
import shutil

import numpy as np

from tests.train.conftest import run_train

FP8_FLAGS = ["--config.model.fp8_matmul=True", "--config.optimizer.moment_dtype=bfloat16",
             "--config.train.checkpoint_every=4", "--config.train.eval_every=100", "--steps=8"]
COMPARED = ("loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "lr")


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_fp8_recipe_resumes_exactly(tmp_path, compile_cache):
    run_train(tmp_path, *FP8_FLAGS, cache_dir=compile_cache)
    reference = _records(tmp_path)
    assert [r["step"] for r in reference] == list(range(1, 9))
    shutil.rmtree(tmp_path / "checkpoints" / "8")  # as if killed between the checkpoints at 4 and 8
    result = run_train(tmp_path, *FP8_FLAGS, cache_dir=compile_cache)
    assert "resumed from" in result.stderr
    resumed = _records(tmp_path)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for got, want in zip(resumed[4:], reference[4:]):
        for key in COMPARED:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=f"step {got['step']} {key}")

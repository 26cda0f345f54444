"""Acceptance 2, shortened: the bias update lowers the expert-load MaxVio (same data and seed)."""

import json

from tests.train.conftest import run_train


def test_bias_update_lowers_maxvio(tmp_path, compile_cache):
    # The test-sized router collapses onto one expert within ~15 steps without the bias (MaxVio
    # E/K - 1 = 3); gamma 0.01 instead of the paper's 0.001 lets a 60-step run pull it back.
    run_train(tmp_path, "--gamma=0.01", "--config.train.eval_every=0", cache_dir=compile_cache,
              module="research.balance_experiment")
    results = json.loads((tmp_path / "results.json").read_text())
    balanced, free = results["0.01"], results["0"]
    assert balanced["maxvio"] < free["maxvio"], results
    assert balanced["mtp_maxvio"] < free["mtp_maxvio"], results

"""Pipeline schedule: equal to a plain scan (forward and gradients), uneven layer counts, bubble."""

import pytest

from sharding import pipeline
from tests.sharding.workers import run_worker


def test_stage_layers_balance_uneven_counts():
    assert pipeline.stage_layers(58, 16) == [4] * 10 + [3] * 6  # DeepSeek-V3's MoE layers on 16 stages
    assert sum(pipeline.stage_layers(58, 16)) == 58
    assert pipeline.stage_layers(6, 4) == [2, 2, 1, 1]
    index, valid = pipeline.layer_slots(6, 4)
    assert index.tolist() == [0, 1, 2, 3, 4, 0, 5, 0]
    assert valid.tolist() == [True, True, True, True, True, False, True, False]


def test_bubble_theory_and_microbatch_choice():
    assert pipeline.bubble_fraction(16, 64) == pytest.approx(15 / 79)
    assert pipeline.num_microbatches_for(64, 4, target_bubble=0.2) == 16  # 3/19 <= 0.2 < 3/11
    assert pipeline.bubble_fraction(4, pipeline.num_microbatches_for(64, 4, 0.2)) <= 0.2


def test_pipeline_matches_sequential_layers_on_eight_devices():
    rows = run_worker("tests.sharding.pipeline_worker")
    assert [(r["stages"], r["layers"], r["microbatches"]) for r in rows] == [(4, 6, 8), (2, 5, 4), (4, 4, 1)]
    for r in rows:
        assert r["out_rel"] < 1e-6 and r["grad_rel"] < 1e-5, r
        assert r["ppermute"], r
        assert r["bubble_measured"] == pytest.approx(r["bubble_theory"], abs=1e-6), r

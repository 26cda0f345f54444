"""Pipeline schedule: equal to a plain scan (forward and gradients), uneven layer counts, bubble."""

import jax.numpy as jnp
import numpy as np
import pytest

from sharding import dualpipev, pipeline, stage_batch
from tests.sharding.workers import run_worker


def test_stage_layers_balance_uneven_counts():
    assert pipeline.stage_layers(58, 16) == [4] * 10 + [3] * 6  # DeepSeek-V3's MoE layers on 16 stages
    assert sum(pipeline.stage_layers(58, 16)) == 58
    assert pipeline.stage_layers(6, 4) == [2, 2, 1, 1]
    index, valid = pipeline.layer_slots(6, 4)
    assert index.tolist() == [0, 1, 2, 3, 4, 0, 5, 0]
    assert valid.tolist() == [True, True, True, True, True, False, True, False]


def test_microbatch_choice_meets_the_target_bubble():
    # bubble_fraction itself is held to the compiled schedule in the eight-device test below.
    assert pipeline.resolve_microbatches(64, 4, target_bubble=0.2) == 16  # 3/19 <= 0.2 < 3/11
    assert pipeline.bubble_fraction(4, pipeline.resolve_microbatches(64, 4, target_bubble=0.2)) <= 0.2


def test_pipeline_matches_sequential_layers_on_eight_devices():
    rows = run_worker("tests.sharding.pipeline_worker")
    assert [(r["stages"], r["layers"], r["microbatches"], r["repeats"], r["schedule"]) for r in rows] == [
        (4, 6, 8, 1, "gpipe"), (2, 5, 4, 1, "gpipe"), (4, 4, 1, 1, "gpipe"), (4, 8, 4, 2, "circular"),
        (2, 5, 3, 2, "circular"), (4, 6, 8, 2, "circular"), (4, 6, 8, 1, "1f1b"), (2, 4, 3, 1, "1f1b"),
        (2, 8, 5, 1, "dualpipev"), (4, 6, 8, 1, "dualpipev")]
    for r in rows:
        assert r["out_rel"] < 1e-6 and r["aux_rel"] < 1e-6 and r["grad_rel"] < 1e-5, r
        assert r["ppermute"], r
        if r["schedule"] == "dualpipev":  # its own forward program; its table is checked below
            continue
        if r["schedule"] == "1f1b":  # GPipe's forward, then F and B alternating: 2 (M + S - 1) units of
            # one hand-off each way, the classic 1F1B length (M + S - 1) (F + B)
            assert r["grad_handoffs"] == 5 * (r["microbatches"] + r["stages"] - 1), r
        # The compiled program runs R*M + S - 1 ticks, and its idle share of matmuls is the theory's
        # bubble when the stages split the layers evenly; uneven stages also run padding slots.
        assert r["ticks"] == r["repeats"] * r["microbatches"] + r["stages"] - 1, r
        if r["layers"] % (r["stages"] * r["repeats"]) == 0:
            assert r["bubble_measured"] == pytest.approx(r["bubble_theory"], abs=1e-9), r
        else:
            assert r["bubble_measured"] > r["bubble_theory"] + 0.05, r


def test_microbatches_keep_every_microbatch_splittable_over_the_batch_shards():
    # 16 rows over 4 batch shards: M in {1, 2, 4}; S=2 reaches bubble 0.2 at M=4.
    assert pipeline.resolve_microbatches(16, 2, batch_shards=4) == 4
    # S=4 needs M >= 12 for 0.2; 16 rows over 2 shards allow at most 8, the largest feasible.
    assert pipeline.resolve_microbatches(16, 4, batch_shards=2) == 8
    assert pipeline.resolve_microbatches(16, 4, batch_shards=2, requested=2) == 2
    with pytest.raises(ValueError, match="pipeline_microbatches=8 must divide the batch of 16 rows"):
        pipeline.resolve_microbatches(16, 4, batch_shards=4, requested=8)
    with pytest.raises(ValueError, match="cannot be split over 32"):
        pipeline.resolve_microbatches(16, 4, batch_shards=32)


def test_microbatch_split_is_inverted_and_keeps_device_blocks():
    x = np.arange(12 * 3).reshape(12, 3)
    mb = np.asarray(pipeline.split_microbatches(jnp.asarray(x), 3))
    assert mb.shape == (3, 4, 3)
    assert mb[1, :, 0].tolist() == [3, 12, 21, 30]  # rows 1, 4, 7, 10
    # 12 rows in 2 device blocks of 6: each microbatch takes 2 rows from each block.
    assert all(sorted(r // 6 for r in mb[i, :, 0] // 3) == [0, 0, 1, 1] for i in range(3))
    np.testing.assert_array_equal(np.asarray(pipeline.merge_microbatches(mb)), x)
    # A batch kept split over S=2 stages (1F1B, DualPipeV): 24 rows on 2 batch shards x 2 stages, in
    # device blocks of 6 (shard major, stage minor), into M=4; stage q's microbatches 2q, 2q + 1 are
    # rows of the blocks (d, q) only, 3 from each of the 2 shards in their order.
    assert not stage_batch.splits_stack_batch("gpipe", 4, 2) and not stage_batch.splits_stack_batch("1f1b", 3, 2)
    assert stage_batch.splits_stack_batch("1f1b", 4, 2) and stage_batch.splits_stack_batch("dualpipev", 4, 2)
    y = np.arange(24 * 2).reshape(24, 2)
    st = np.asarray(stage_batch.split_stage_microbatches(jnp.asarray(y), 4, 2, 2))
    assert st.shape == (4, 6, 2)
    blocks = st[:, :, 0] // 2 // 6  # the device block (d * 2 + q) of each row
    assert blocks.tolist() == [[0] * 3 + [2] * 3] * 2 + [[1] * 3 + [3] * 3] * 2
    np.testing.assert_array_equal(np.asarray(stage_batch.merge_stage_microbatches(jnp.asarray(st), 2, 2)), y)
    with pytest.raises(ValueError, match="24 rows do not split into 3 microbatches over 2 stages"):
        stage_batch.split_stage_microbatches(jnp.asarray(y), 3, 2, 2)


def test_circular_slots_bubble_and_microbatches():
    # 5 layers, 2 stages x 2 rounds = 4 chunks of 2 slots: chunk sizes 2, 1, 1, 1 in layer order;
    # stage 0 holds chunks 0 and 2 (layers 0-1, 3), stage 1 chunks 1 and 3 (layers 2, 4).
    index, valid = pipeline.layer_slots(5, 2, repeats=2)
    assert index.tolist() == [0, 1, 3, 0, 2, 0, 4, 0]
    assert valid.tolist() == [True, True, True, False, True, False, True, False]
    assert pipeline.slots_per_stage(5, 2, repeats=2) == 4
    # the circular schedule needs M >= S: 16 rows over 8 shards allow M in {1, 2}, both < 4 stages
    with pytest.raises(ValueError, match="at least 4 microbatches"):
        pipeline.resolve_microbatches(16, 4, batch_shards=8, repeats=2)
    with pytest.raises(ValueError, match="fewer than the 4 stages"):
        pipeline.resolve_microbatches(16, 4, batch_shards=1, requested=2, repeats=2)
    assert pipeline.resolve_microbatches(64, 4, batch_shards=2, repeats=2) == 8  # 3/19 <= 0.2 < 3/11


@pytest.mark.parametrize("stages, micro", [(4, 8), (4, 32), (2, 5), (3, 1)])
def test_dualpipev_table_runs_every_chunk_once_in_dependency_order(stages, micro):
    table = dualpipev.schedule_table(stages, micro)
    t = table.rows
    chunks = 2 * stages
    ran = {}  # (kind, chunk, microbatch) -> unit
    for u in range(table.units):
        for r in range(stages):
            for kind in "fbw":
                if t[f"{kind}_on"][u, r]:
                    v, j = t[f"{kind}_v"][u, r], t[f"{kind}_m"][u, r]
                    c = r if v == 0 else chunks - 1 - r  # the V: rank r holds chunks r and 2S-1-r
                    assert (kind, c, j) not in ran
                    ran[kind, c, j] = u
            if t["f_on"][u, r] and t["b_on"][u, r]:  # F and B in one unit are different microbatches
                assert t["f_m"][u, r] != t["b_m"][u, r] or t["f_v"][u, r] != t["b_v"][u, r]
    assert len(ran) == 3 * chunks * micro
    for c in range(chunks):
        for j in range(micro):
            assert c == 0 or ran["f", c - 1, j] < ran["f", c, j]  # input came from the chunk before
            assert ran["f", c, j] < ran["b", c, j] < ran["w", c, j]  # B before its deferred W
            assert c == chunks - 1 or ran["b", c + 1, j] < ran["b", c, j]


def test_dualpipev_memory_does_not_grow_with_microbatches():
    sizes = {m: dualpipev.schedule_table(4, m) for m in (8, 16, 64)}
    assert len({(t.stash, t.inbox_a, t.inbox_g, t.wait_w) for t in sizes.values()}) == 1
    # 1F1B's bound on 2S virtual stages: chunk c holds at most 2S - c microbatches, rank r
    # (chunks r and 2S-1-r) 2S + 1, plus the deferred weight gradients, plus the dump slot.
    assert sizes[64].stash <= 2 * 4 + 1 + 3 + 1


def test_pipeline_schedule_field_is_checked_and_repeats_mean_circular():
    from dsv3_jax.config import ConfigError, ModelConfig

    assert ModelConfig().pipeline_schedule == "gpipe"
    assert ModelConfig(pipeline_repeats=2).pipeline_schedule == "circular"  # the older spelling
    with pytest.raises(ConfigError, match="pipeline_schedule must be one of"):
        ModelConfig(pipeline_schedule="zb-h1")
    with pytest.raises(ConfigError, match="pipeline_schedule='circular' takes pipeline_repeats >= 2"):
        ModelConfig(pipeline_schedule="circular")
    with pytest.raises(ConfigError, match="pipeline_schedule='1f1b' takes pipeline_repeats=1"):
        ModelConfig(pipeline_schedule="1f1b", pipeline_repeats=2)

"""Chunked prefill compiles per (batch, cache bucket, chunk shape), never per prompt length."""

import math

import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.inference import generate
from dsv3_jax.inference.prefill import plan
from tests.inference.conftest import tiny_config

CHUNK = 512


def test_plan_covers_the_prompt_with_few_shapes():
    for length in range(1, 3000, 7):
        spans = plan(length, CHUNK)
        assert spans[0][0] == 0 and all(s + w == s2 for (s, w), (s2, _) in zip(spans, spans[1:]))
        end = spans[-1][0] + spans[-1][1]
        assert length <= end < length + max(16, length % CHUNK or CHUNK)  # padding below a power of two
    assert {w for n in range(1, 3000) for _, w in plan(n, CHUNK)} == {16, 32, 64, 128, 256, 512}
    with pytest.raises(ValueError, match="prefill_chunk"):
        plan(10, 48)


def test_100_prompt_lengths_compile_at_most_buckets_times_chunk_shapes():
    cfg = tiny_config(num_layers=1, num_dense_layers=1, num_mtp_layers=0, max_position_embeddings=4096)
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    lengths = np.unique(np.linspace(1, 4000, 100).astype(int))
    assert len(lengths) == 100
    rng = np.random.RandomState(0)
    traces = 0
    for n in lengths:
        prompt = rng.randint(0, cfg.vocab_size, (1, n)).astype(np.int32)
        _, stats = generate(model, prompt, 1, prefill_chunk=CHUNK, return_stats=True)
        assert stats.prefill_chunks == math.ceil(n / CHUNK)
        traces += stats.prefill_traces
    buckets = {max(16, 1 << int(n).bit_length()) for n in lengths}  # cache slots: a power of two > n
    chunk_shapes = int(math.log2(CHUNK)) - 3  # 16 .. CHUNK
    assert 0 < traces <= len(buckets) * chunk_shapes, (traces, len(buckets), chunk_shapes)
    _, stats = generate(model, rng.randint(0, cfg.vocab_size, (1, 3333)).astype(np.int32), 1, prefill_chunk=CHUNK,
                        return_stats=True)
    assert stats.prefill_traces == 0  # a new length in a known bucket reuses its compiled chunks

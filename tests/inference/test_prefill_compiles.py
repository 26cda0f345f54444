"""Chunked prefill compiles once per (batch, cache bucket), never per prompt length."""

import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.inference import Generation, generate
from dsv3_jax.inference.prefill import plan
from tests.inference.conftest import VOCAB, jax_compiles, tiny_config

CHUNK = 64


def test_plan_covers_the_prompt_in_chunks_of_one_width():
    for length in range(1, 3000, 7):
        spans = plan(length, CHUNK)
        assert spans[0][0] == 0 and all(s + w == s2 for (s, w), (s2, _) in zip(spans, spans[1:]))
        end = spans[-1][0] + spans[-1][1]
        assert length <= end < length + CHUNK  # only the last chunk is padded
    assert {w for n in range(1, 3000) for _, w in plan(n, CHUNK)} == {CHUNK}
    with pytest.raises(ValueError, match="prefill_chunk"):
        plan(10, 48)


def test_100_prompt_lengths_compile_one_prefill_and_one_decode_per_cache_bucket():
    cfg = tiny_config(num_layers=1, num_dense_layers=1, num_mtp_layers=0, max_position_embeddings=512)
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    lengths = np.unique(np.linspace(1, 500, 100).astype(int))
    assert len(lengths) == 100
    rng = np.random.RandomState(0)
    prefill_traces = decode_traces = 0
    slots = set()
    for n in lengths:
        gen = Generation(model, rng.randint(0, cfg.vocab_size, (1, n)).astype(np.int32), 2, prefill_chunk=CHUNK)
        for _ in gen:
            pass
        assert gen.stats.prefill_chunks == -(-n // CHUNK)
        slots.add(gen.cache.dense.latent.shape[2])
        prefill_traces += gen.stats.prefill_traces
        decode_traces += gen.stats.decode_traces
    assert min(slots) == CHUNK and len(slots) == 4, slots  # 64 .. 512: prompts below a chunk share one
    assert prefill_traces == len(slots), (prefill_traces, slots)
    assert decode_traces == len(slots), (decode_traces, slots)
    gen = Generation(model, rng.randint(0, cfg.vocab_size, (1, 333)).astype(np.int32), 1, prefill_chunk=CHUNK)
    for _ in gen:
        pass
    assert gen.stats.prefill_traces == 0  # a new length in a known bucket reuses its compiled chunk


@pytest.mark.parametrize("use_mtp", [False, True])
def test_a_new_prompt_length_in_a_compiled_bucket_compiles_nothing(use_mtp):
    """Not the steps, nor any small program around them: padding and positions are host numpy."""
    model = DeepSeekV3(tiny_config(), rngs=nnx.Rngs(0))
    rng = np.random.RandomState(1)

    def run(length, **kw):
        prompts = rng.randint(0, VOCAB, (2, length)).astype(np.int32)
        return generate(model, prompts, 3, lengths=np.array([length, 1]), prefill_chunk=16, use_mtp=use_mtp, **kw)

    gen = Generation(model, rng.randint(0, VOCAB, (2, 20)).astype(np.int32), 6, lengths=np.array([20, 1]),
                     prefill_chunk=16, use_mtp=use_mtp, temperature=0.7)
    steps = iter(gen)
    next(steps), next(steps)  # the prefill's token, then the first decode step (compiles it)
    with jax_compiles() as later:
        assert sum(1 for _ in steps) >= 1
    assert later == [], "a decode step after the first compiled again (its inputs must keep one signature)"
    run(20, temperature=0.7)  # 20 + 3 new tokens: the 32-slot bucket, two chunks
    with jax_compiles() as compiles:
        for length in (17, 22, 27):  # + 3 new + 1 draft: all in the 32-slot bucket
            run(length, temperature=0.7)
    assert compiles == []

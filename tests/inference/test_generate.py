"""Greedy generation over the latent cache against the full-sequence forward; compilation reuse; errors."""

import jax
import numpy as np
import pytest

from dsv3_jax.inference import generate
from tests.inference.conftest import MAX_NEW, VOCAB


def test_greedy_equals_full_forward_argmax_ragged(model, ragged_batch, greedy_reference):
    prompts, lengths = ragged_batch
    expected, gap = greedy_reference
    assert gap > 1e-2, f"reference argmax is a near-tie (gap {gap}); the comparison would prove little"
    out = np.asarray(generate(model, prompts, MAX_NEW, lengths=lengths, pad_id=0))
    assert out.shape == (3, 7 + MAX_NEW) and out.dtype == np.int32
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(out[b, :n + MAX_NEW], expected[b, :n + MAX_NEW], err_msg=f"row {b}")
        assert (out[b, n + MAX_NEW:] == 0).all(), "slots past a row's generated tokens hold pad_id"


@pytest.mark.parametrize("chunk", [2, 4])
def test_chunked_prefill_equals_full_forward_argmax(model, ragged_batch, greedy_reference, chunk):
    """Chunks smaller than the prompt (7 tokens in chunks of 2 or 4, the last one padded)."""
    prompts, lengths = ragged_batch
    out, stats = generate(model, prompts, MAX_NEW, lengths=lengths, prefill_chunk=chunk, return_stats=True)
    assert stats.prefill_chunks == -(-7 // chunk)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(out)[b, :n + MAX_NEW], greedy_reference[0][b, :n + MAX_NEW])


def test_one_compiled_decode_step_for_every_token_and_length(model, ragged_batch, greedy_reference):
    prompts, lengths = ragged_batch
    generate(model, prompts, MAX_NEW, lengths=lengths)  # compiled (or already compiled by another test)
    short, stats = generate(model, prompts, 3, lengths=lengths, return_stats=True)  # same bucket, fewer steps
    assert (stats.prefill_traces, stats.decode_traces) == (0, 0), stats
    _, stats = generate(model, np.abs(prompts), MAX_NEW, lengths=np.array([2, 6, 3], np.int32), return_stats=True)
    assert (stats.prefill_traces, stats.decode_traces) == (0, 0), "other lengths in the bucket traced again"
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(short)[b, :n + 3], greedy_reference[0][b, :n + 3])


def test_stop_tokens_pad_the_rest(model, ragged_batch, greedy_reference):
    prompts, lengths = ragged_batch
    expected = greedy_reference[0]
    stop = int(expected[0, lengths[0] + 2])  # row 0's third generated token
    out = np.asarray(generate(model, prompts, MAX_NEW, lengths=lengths, stop_tokens=(stop,), pad_id=VOCAB - 1))
    for b, n in enumerate(lengths):
        gen = expected[b, n:n + MAX_NEW].tolist()
        keep = gen.index(stop) + 1 if stop in gen else MAX_NEW
        np.testing.assert_array_equal(out[b, n:n + keep], gen[:keep])
        assert (out[b, n + keep:] == VOCAB - 1).all()
    assert keep <= MAX_NEW and expected[0, lengths[0] + 2] == stop


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=np.array([[1, VOCAB]], np.int32)), r"vocab_size=64.*position=1"),
    (dict(max_new_tokens=2000), "max_position_embeddings"),
    (dict(lengths=np.array([0], np.int32)), "lengths"),
    (dict(stop_tokens=(VOCAB,)), "stop_tokens"),
    (dict(cache_dtype="int4"), "cache_dtype"),
    (dict(prefill_chunk=24), "prefill_chunk"),
    (dict(page_size=0), "page_size"),
    (dict(page_size=4, cache_sharding=jax.sharding.NamedSharding(jax.sharding.AbstractMesh((4,), ("expert",)),
                                                                 jax.sharding.PartitionSpec())),
     "page_size on a mesh: the batch of 1 rows must split evenly over its 4 batch shards"),
    (dict(prompts=np.array([1, 2], np.int32)), r"\[batch, length\]"),
])
def test_errors_name_the_problem(model, kwargs, match):
    args = dict(prompts=np.array([[1, 2]], np.int32), max_new_tokens=2) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(model, args.pop("prompts"), args.pop("max_new_tokens"), **args)

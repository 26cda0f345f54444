"""A paged latent cache (a pool of pages written and read through a page table) against the
contiguous cache on the same tokens: a cached forward's logits over prompt chunks (the expanded
form) then decode steps (the absorbed form), and a write through no page."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.inference import generate
from dsv3_jax.inference.cache import init_cache
from dsv3_jax.model.attention import EXPANDED_MIN_WIDTH, LatentCache
from dsv3_jax.model.rope import rope_angles
from dsv3_jax.ops.latent_attention import encode
from tests.inference.conftest import MAX_NEW, VOCAB, tiny_config

B, K, M = 2, 8, 8  # rows, slots per page, page-table entries per row: 64 positions a row
SPARE = 3  # pool pages no row owns
GARBAGE = 100.0  # every pool entry before it is written: one such key read would swamp a softmax
W = EXPANDED_MIN_WIDTH
SPANS = [(0, W), (W, W), (2 * W, 3), (2 * W + 3, 1)]  # (start, width): 2 prompt chunks, a verify window, a decode


def _cached_logits(model, tokens_BxT, cache, spans=SPANS):
    """float32 logits [B, T, V] of the tokens fed through `cache` span by span (one jitted program)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, cache):
        m, out = nnx.merge(graphdef, state), []
        for start, width in spans:
            positions = jnp.broadcast_to(jnp.arange(start, start + width, dtype=jnp.int32), (B, width))
            step = m.forward(tokens_BxT[:, start:start + width], positions=positions, with_mtp=False, cache=cache)
            cache, out = step.cache, out + [step.logits]
        return jnp.concatenate(out, axis=1)

    return np.asarray(run(state, cache))


def _paged(cfg, cache_dtype: str):
    """A pool of B * M + SPARE pages holding GARBAGE (`init_cache` with pages for rows and a page's
    slots for positions), each row's M pages at shuffled ids."""
    pool = jax.tree.map(lambda a: jnp.full_like(a, GARBAGE), init_cache(cfg, B * M + SPARE, K, cache_dtype))
    table_BxM = np.random.default_rng(0).permutation(B * M + SPARE)[:B * M].reshape(B, M)
    return pool._replace(page_table=jnp.asarray(table_BxM, jnp.int32))


@pytest.fixture(scope="module")
def dense_model():
    """Two dense layers: the cache is attention's, and a model without MoE layers compiles fast."""
    return DeepSeekV3(tiny_config(num_layers=2, num_dense_layers=2, num_mtp_layers=0), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8"])
def test_paged_cached_forward_equals_the_contiguous_one(dense_model, cache_dtype):
    model, t = dense_model, SPANS[-1][0] + 1
    tokens = jax.random.randint(jax.random.key(3), (B, t), 0, VOCAB, jnp.int32)
    want = _cached_logits(model, tokens, init_cache(model.config, B, M * K, cache_dtype))
    got = _cached_logits(model, tokens, _paged(model.config, cache_dtype))
    assert np.std(want) > 1.0  # O(1) logits: the tolerance is meaningful
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_a_write_through_no_page_is_dropped():
    """Row 0 holds page 2 then none (-1): its entry at position 3 lands in page 2 at offset 3, the one
    at 5 (no page) and the one at 8 (past the table) nowhere, and no other page changes."""
    pool = LatentCache(jnp.zeros((3, 4, 2)), None, jnp.zeros((3, 4, 1)))
    entries = LatentCache(jnp.ones((1, 3, 2)), None, jnp.ones((1, 3, 1)))
    out = pool.write(entries, jnp.array([[3, 5, 8]]), page_table=jnp.array([[2, -1]]))
    want = np.zeros((3, 4, 2))
    want[2, 3] = 1
    np.testing.assert_array_equal(out.latent, want)
    np.testing.assert_array_equal(out.k_pe, want[..., :1])


SPARSE = dict(index_n_heads=2, index_head_dim=16, index_topk=8)  # V3.2: past position 8 a query keeps 8 entries


@pytest.fixture(scope="module")
def sparse_attn():
    """A V3.2 model's MLA (lightning indexer, index_topk 8), out of its one-layer stack."""
    model = DeepSeekV3(tiny_config(num_layers=1, num_dense_layers=1, num_mtp_layers=0, **SPARSE), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model.dense_layers.attn)
    return nnx.merge(graphdef, state), model.config


def _sparse_outputs(attn, x_BxTxD, stack, page_table, spans):
    """MLA outputs [B, T, D] of x fed span by span through a layer stack's cache (layer 0; with a
    page table, a pool of pages): one jitted program."""
    graphdef, state = nnx.split(attn)

    @jax.jit
    def run(state, stack, page_table):
        m, out = nnx.merge(graphdef, state), []
        for start, width in spans:
            positions = jnp.broadcast_to(jnp.arange(start, start + width, dtype=jnp.int32), (B, width))
            cos, sin = rope_angles(positions, attn.cfg)
            step, entries = m(x_BxTxD[:, start:start + width], cos, sin, cache=stack, positions=positions, layer=0,
                              page_table=page_table)
            stack, out = stack.write(entries, positions, 0, page_table), out + [step]
        return jnp.concatenate(out, axis=1)

    return np.asarray(run(jax.tree.map(lambda a: a[0], state), stack, page_table))


def test_paged_sparse_attention_equals_the_contiguous_one(sparse_attn):
    """A prompt chunk, a verify window and a decode step of V3.2's MLA over a float8 cache: the index
    keys and their scales live in the latent's pages, the indexer scores each row's own keys through
    its table and the sparse attention gathers the chosen latents through it."""
    (attn, cfg), spans = sparse_attn, [(0, W), (W, 3), (W + 3, 1)]
    x = jax.random.normal(jax.random.key(4), (B, W + 4, cfg.hidden_size))
    want = _sparse_outputs(attn, x, init_cache(cfg, B, M * K, "float8").dense, None, spans)
    pool = _paged(cfg, "float8")
    got = _sparse_outputs(attn, x, pool.dense, pool.page_table, spans)
    assert np.std(want) > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("use_mtp", [False, True])
def test_generate_on_a_paged_cache_equals_the_full_forward(model, ragged_batch, greedy_reference, use_mtp):
    """Pages of 4 tokens, prompts of 7, 4 and 1 tokens prefilled in chunks of 4 (the later chunks
    read earlier pages): each row's greedy tokens are the full forward's argmax."""
    prompts, lengths = ragged_batch
    out, stats = generate(model, prompts, MAX_NEW, lengths=lengths, prefill_chunk=4, page_size=4, use_mtp=use_mtp,
                          return_stats=True)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(out)[b, :n + MAX_NEW], greedy_reference[0][b, :n + MAX_NEW])
    assert stats.decode_traces <= 1  # the page table's rows change nothing a compile depends on


def test_the_pallas_decode_reads_the_pages():
    """attention_impl="pallas": a one-token decode over pages of 128 (a TPU lane block; in interpret
    mode here), at shuffled ids among GARBAGE pages, equals the XLA decode over the same fp8 tokens
    laid out contiguously."""
    cfg, k = tiny_config(num_layers=1, num_dense_layers=1, num_mtp_layers=0), 128
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (B, 1, cfg.hidden_size))
    cache = LatentCache(*encode(jax.random.normal(keys[1], (B, 2 * k, cfg.kv_lora_rank)),
                                jax.random.normal(keys[2], (B, 2 * k, cfg.qk_rope_head_dim)), "float8"))
    table_BxM = jnp.array([[3, 0], [1, 4]], jnp.int32)  # pages 2 and 5 are no row's
    pool = LatentCache(*(None if a is None else jnp.full((6, k, a.shape[-1]), GARBAGE, a.dtype)
                         .at[table_BxM].set(a.reshape(B, 2, k, -1)) for a in cache))
    positions = jnp.array([[7], [k + 33]], jnp.int32)
    cos, sin = rope_angles(positions, cfg)
    outs = {}
    for impl, c, table in (("xla", cache, None), ("pallas", pool, table_BxM)):
        attn = DeepSeekV3(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(0)).dense_layers.attn
        graphdef, state = nnx.graphdef(attn), jax.tree.map(lambda a: a[0], nnx.state(attn))
        run = jax.jit(lambda s, c, t: nnx.merge(graphdef, s)(x, cos, sin, cache=c, positions=positions, page_table=t))
        outs[impl] = np.asarray(run(state, c, table)[0])
    assert np.std(outs["xla"]) > 0.1
    np.testing.assert_allclose(outs["pallas"], outs["xla"], rtol=2e-4, atol=2e-4 * np.abs(outs["xla"]).max())


"""DeepSeek-V3.2: the lightning indexer and sparse attention against transformers'
DeepseekV32ForCausalLM (fp32, index_topk 16, queries with fewer and more keys than it), HF folders
both ways, the sparse forward below index_topk equal to the dense one, and sparse attention through
the latent cache (prefill chunks, decode, generate and the serving engine, with and without MTP)
against the forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax.checkpoint import load_pretrained
from dsv3_jax.checkpoint.safetensors_io import HFCheckpoint
from dsv3_jax.config import ModelConfig
from dsv3_jax.data import load_tokenizer
from dsv3_jax.inference import generate, init_cache
from dsv3_jax.model.attention import LatentCache
from dsv3_jax.model.indexer import cached_topk
from dsv3_jax.ops import latent_attention
from dsv3_jax.model.rope import rope_angles
from dsv3_jax.model.transformer import DeepSeekV3
from dsv3_jax.serving import Engine, Request, Runner, SamplingParams
from tests.checkpoint.conftest import convert, tiny_cfg
from tests.checkpoint.test_roundtrip import assert_same_tensors
from tests.helpers import TokenSink

TOPK = 16
V32 = tiny_cfg(num_layers=2, num_mtp_layers=0, param_dtype="float32", index_n_heads=8, index_head_dim=32,
               index_topk=TOPK)
TOKENS = np.random.default_rng(0).integers(0, V32.vocab_size, (2, 40)).astype(np.int32)
N = 24  # the MLA tests' length: past index_topk (queries from the 17th on keep 16 of their keys)


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """{"folder": transformers' save_pretrained of a DeepseekV32ForCausalLM, "hf": the model,
    "model": ours loaded from the folder, "logits": HF's fp32 logits of TOKENS}."""
    pytest.importorskip("torch")
    from tests.hf_reference import build_hf_model, hf_logits

    folder = tmp_path_factory.mktemp("v32") / "hf"
    hf = build_hf_model(V32, seed=3)
    hf.save_pretrained(folder)
    out = {"folder": folder, "hf": hf, "model": load_pretrained(folder, "float32")}
    return out | {"logits": hf_logits(hf, TOKENS)}


def test_v32_logits_match_transformers(v32):
    """40 tokens: the first 16 queries see fewer keys than index_topk (dense), the later ones keep 16."""
    assert v32["model"].config.index_topk == TOPK
    assert np.abs(v32["logits"]).max() > 1.0
    assert np.abs(np.asarray(v32["model"](TOKENS)) - v32["logits"]).max() <= 1e-4


def test_the_selection_matters_past_index_topk(v32):
    """The same weights attending densely (index_topk >= length) give other logits past 16 tokens:
    the parity above checks the selection, not dense attention."""
    dense = load_pretrained(v32["folder"], "float32", index_topk=64)
    assert np.abs(np.asarray(dense(TOKENS)) - v32["logits"]).max() > 1e-2


def _first_attn(model):
    """The first dense layer's MLA, out of its stack."""
    graphdef, state = nnx.split(model.dense_layers.attn)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))


@pytest.fixture(scope="module")
def attns(v32):
    """(the V3.2 model's first MLA, the same weights without the indexer: dense MLA)."""
    sparse = v32["model"]
    dense = nnx.eval_shape(lambda: DeepSeekV3(sparse.config.replace(index_n_heads=0, index_head_dim=0, index_topk=0),
                                              rngs=nnx.Rngs(0)))  # every value replaced below
    state = nnx.state(sparse)
    for stack in ("dense_layers", "moe_layers"):
        del state[stack]["attn"]["indexer"]
    nnx.update(dense, state)
    return _first_attn(sparse), _first_attn(dense)


_expanded = nnx.jit(lambda attn, *args, **kw: attn.expanded(*args, **kw), static_argnames="indexer_terms")


def _inputs(length: int):
    x = jnp.asarray(0.1 * np.random.default_rng(1).normal(size=(2, length, V32.hidden_size)), jnp.float32)  # no exp underflows to 0
    return (x, *rope_angles(jnp.broadcast_to(jnp.arange(length), (2, length)), V32))


def test_below_index_topk_sparse_equals_dense_exactly(attns):
    """A query with at most index_topk keys keeps all of them: a call of index_topk tokens equals,
    bit for bit, the dense MLA on the same weights; past it, the indexer run and its selection
    masking the scores, it equals the dense MLA exactly on the first index_topk queries and differs
    after."""
    (sparse, dense), (x, cos, sin) = attns, _inputs(N)
    short = x[:, :TOPK], cos[:, :TOPK], sin[:, :TOPK]
    np.testing.assert_array_equal(np.asarray(_expanded(sparse, *short)), np.asarray(_expanded(dense, *short)))
    out = np.asarray(sparse.expanded(x, cos, sin, indexer_terms=True)[0])  # eager: op for op the dense ones
    want = np.asarray(dense.expanded(x, cos, sin))
    np.testing.assert_array_equal(out[:, :TOPK], want[:, :TOPK])
    assert np.all(np.abs(out[:, TOPK:] - want[:, TOPK:]).max(axis=-1) > 0)


def _cached(attn, x, cos, sin, widths, cache_dtype="float32"):
    """MLA through one layer's latent cache, the call cut into calls of `widths` tokens -> [B, T, D]."""
    cfg = V32 if hasattr(attn, "indexer") else V32.replace(index_n_heads=0, index_head_dim=0, index_topk=0)
    cache = jax.tree.map(lambda a: a[0], init_cache(cfg, 2, 32, cache_dtype).dense)
    outs, start, call = [], 0, nnx.jit(lambda m, *args, **kw: m(*args, **kw))
    for w in widths:
        positions = jnp.broadcast_to(jnp.arange(start, start + w), (2, w))
        part = slice(start, start + w)
        out, entries = call(attn, x[:, part], cos[:, part], sin[:, part], cache=cache, positions=positions)
        outs.append(out)
        cache = cache.write(entries, positions)
        start += w
    return np.asarray(jnp.concatenate(outs, axis=1))


def test_sparse_attention_through_the_cache_equals_the_forward(attns):
    """A 16-token prefill chunk then an 8-token call (verify: decode's absorbed form) through the fp32 cache:
    within 1e-5 of the cacheless sparse forward (the HF-parity reference); while no query sees more
    than index_topk tokens, the dense MLA's cached calls (the same function, run under lax.cond:
    XLA compiles the branch apart, so equal to fp32 rounding, not bit for bit); past it, other
    outputs."""
    (sparse, dense), (x, cos, sin) = attns, _inputs(N)
    widths = (TOPK, N - TOPK)
    out, want = _cached(sparse, x, cos, sin, widths), _cached(dense, x, cos, sin, widths)
    np.testing.assert_allclose(out, np.asarray(_expanded(sparse, x, cos, sin)), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[:, :TOPK], want[:, :TOPK], atol=2e-6, rtol=0)
    assert np.all(np.abs(out[:, TOPK:] - want[:, TOPK:]).max(axis=-1) > 1e-4)


@pytest.mark.parametrize("cache_dtype", ["float8"])
def test_pallas_selection_and_sparse_decode_equal_the_gather_on_quantised_caches(cache_dtype):
    """One decode query per row over a float8 / int8 cache (latent and index keys with their scales):
    the indexer kernel's top-k equals the jnp scores' top-k, and the sparse decode kernel merged
    with the token's own entry equals the gather of the same rows; the same with the cache laid out
    as a pool of pages (a row's 5 pages of 8 shuffled among pages holding garbage): the indexer
    kernel scores each row's keys read through its table, the decode kernel reads the pool's slots."""
    b, s, h, c, r, i, k = 2, 40, 4, 32, 8, 2, 32
    rng = np.random.default_rng(cache_dtype == "int8")
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    cache = LatentCache(*latent_attention.encode(normal(b, s, c), normal(b, s, r), cache_dtype),
                        *latent_attention.encode_index_key(normal(b, s, k), cache_dtype))
    own, own_k, positions = (normal(b, 1, c), normal(b, 1, r)), normal(b, 1, k), jnp.array([[33], [20]])
    q_index, w_index = normal(b, 1, i, k), normal(b, 1, i)
    topk = jax.jit(cached_topk, static_argnames=("topk", "pallas"))
    chosen = topk(q_index, w_index, cache, own_k, positions, TOPK)
    np.testing.assert_array_equal(topk(q_index, w_index, cache, own_k, positions, TOPK, pallas=True), chosen)
    picked = np.asarray(chosen)[:, 0]  # [B, TOPK]: cache slots before the position, or s (own entry)
    assert all(len(set(row)) == TOPK and all(j < p or j == s for j in row) for row, p in zip(picked, [33, 20]))
    q_lat, q_pe = normal(b, 1, h, c), normal(b, 1, h, r)
    kw = dict(softmax_scale=0.2, compute_dtype=jnp.float32)
    kernel = jax.jit(functools.partial(latent_attention.attend_sparse_pallas, **kw))
    rows = latent_attention.read_chosen(cache, None, chosen, jnp.float32)
    want = latent_attention.attend_sparse(q_lat, q_pe, rows, own, chosen, s, **kw)
    np.testing.assert_allclose(kernel(q_lat, q_pe, cache, own, chosen), want, atol=1e-5)
    table_BxM = jnp.asarray(rng.permutation(2 * b * 5)[:b * 5].reshape(b, 5), jnp.int32)
    pool = LatentCache(*(jnp.full((2 * b * 5, 8, a.shape[-1]), 100.0, a.dtype).at[table_BxM].set(a.reshape(b, 5, 8, -1))
                         for a in cache))
    paged_topk = topk(q_index, w_index, pool, own_k, positions, TOPK, pallas=True, page_table=table_BxM)
    np.testing.assert_array_equal(paged_topk, chosen)
    np.testing.assert_allclose(kernel(q_lat, q_pe, pool, own, chosen, page_table=table_BxM), want, atol=1e-5)


def test_indexer_terms_hook(attns):
    """MLA's hook for training the indexer: the forward unchanged, the indexer's causal logits and
    the main attention's probabilities summed over heads, over min(t + 1, index_topk) keys."""
    attn, (x, cos, sin) = attns[0], _inputs(N)
    out, terms = _expanded(attn, x, cos, sin, indexer_terms=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_expanded(attn, x, cos, sin)))
    logits, probs = np.asarray(terms.logits), np.asarray(terms.attn_probs)
    assert logits.shape == probs.shape == (2, N, N)
    above = np.triu(np.ones((N, N), bool), 1)
    assert np.all(np.isneginf(logits[:, above])) and np.all(np.isfinite(logits[:, ~above]))
    np.testing.assert_allclose(probs.sum(-1), V32.num_heads, rtol=1e-5)
    kept = (probs > 0).sum(-1)  # keys attended per query
    np.testing.assert_array_equal(kept, np.broadcast_to(np.minimum(np.arange(1, N + 1), TOPK), (2, N)))


def test_greedy_generation_through_the_cache_equals_the_forward_argmax():
    """Prompts of 30 and 9 tokens (past and below index_topk 16), prefill chunks of 16, greedy
    decode with and without MTP drafts (the MTP layer has its own indexer), by generate() on the
    contiguous cache and on a paged one (pages of 8: the index keys live in the latent's pages) and
    by the server's runner and engine on a paged cache with MTP: the full forward's argmax, token by
    token."""
    from tests.inference.conftest import full_forward_greedy, tiny_config

    model = DeepSeekV3(tiny_config(num_layers=2, index_n_heads=2, index_head_dim=32, index_topk=TOPK,
                                   num_mtp_layers=1), rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(2).integers(0, model.config.vocab_size, (2, 30)).astype(np.int32)
    lengths, max_new = np.array([30, 9], np.int32), 6
    expected, gap = full_forward_greedy(model, prompts, lengths, max_new)
    assert gap > 1e-4, f"reference argmax is a near-tie (gap {gap})"
    for use_mtp, page_size in ((False, None), (True, None), (False, 8)):
        out = np.asarray(generate(model, prompts, max_new, lengths=lengths, prefill_chunk=TOPK, use_mtp=use_mtp,
                                  page_size=page_size))
        for b, n in enumerate(lengths):
            np.testing.assert_array_equal(out[b, :n + max_new], expected[b, :n + max_new],
                                          err_msg=f"{use_mtp=} {page_size=} {b=}")
    # the server's path: both requests batched in the serving runner's slots, MTP drafts verified per slot
    runner = Runner(model, max_batch=2, max_seq_len=64, chunk=TOPK, use_mtp=True, page_size=8, cache_tokens=96)
    engine = Engine(runner, load_tokenizer())
    engine.start()
    try:
        sinks = [TokenSink() for _ in lengths]
        for b, n in enumerate(lengths):
            engine.submit(Request(prompts[b, :n].tolist(), SamplingParams(max_tokens=max_new, ignore_eos=True), sinks[b]))
        assert all(sink.done.wait(300) for sink in sinks), "a request never finished"
    finally:
        engine.shutdown()
    for b, n in enumerate(lengths):
        assert sinks[b].tokens == expected[b, n:n + max_new].tolist(), f"served request {b}"


def test_v32_round_trip_through_our_checkpoint_loads_in_transformers(v32, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.hf_reference import hf_logits

    assert convert("--hf-dir", v32["folder"], "--out", tmp_path / "ckpt") == 0
    assert convert("--to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf") == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                             experts_implementation="eager").float().eval()
    assert type(back).__name__ == "DeepseekV32ForCausalLM"
    np.testing.assert_array_equal(hf_logits(back, TOKENS), v32["logits"])


def test_v32_fp8_folder_with_mtp_round_trips_bit_exact(tmp_path):
    """A hub-shaped V3.2 folder (FP8 indexer wq_b / wk with their scales, an MTP layer that has its
    own indexer) -> ours (--keep-fp8) -> HF gives back the same bytes."""
    from benchmarks.make_synthetic_checkpoint import make_checkpoint

    cfg = tiny_cfg(index_n_heads=2, index_head_dim=32, index_topk=4)
    make_checkpoint(cfg, tmp_path / "src", use_fp8=True, seed=1)
    names = HFCheckpoint(tmp_path / "src").names()
    assert "model.layers.3.self_attn.indexer.wq_b.weight_scale_inv" in names  # the MTP layer's
    assert "model.layers.0.self_attn.indexer.weights_proj.weight_scale_inv" not in names
    assert convert("--hf-dir", tmp_path / "src", "--out", tmp_path / "ckpt", "--keep-fp8") == 0
    assert convert("--to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf", "--fp8") == 0
    assert_same_tensors(tmp_path / "src", tmp_path / "hf")
    assert ModelConfig.from_hf_config(tmp_path / "hf").index_topk == 4


def test_v32_cache_counts_the_index_key():
    """Per token and layer, V3.2 adds its 128-value index key to MLA's latent row: in bf16 2 x 128
    bytes; in float8 / int8 128 one-byte values and one fp32 scale."""
    from dsv3_jax.inference import cache_bytes_per_token

    v3, v32 = ModelConfig.deepseek_v3(), ModelConfig.deepseek_v3_2()
    for cache_dtype, extra in (("bfloat16", 256), ("float8", 132), ("int8", 132), ("float32", 512)):
        assert cache_bytes_per_token(v32, cache_dtype) == cache_bytes_per_token(v3, cache_dtype) + extra

"""Multi-head Latent Attention, one module with two forms chosen per call.

Letters: B batch, T length, S cache slots, D model, H heads, Q q_lora_rank, C kv_lora_rank (latent),
N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim, K = N + R, L layers of a stack.

c_q = RMSNorm(x W_qa); q = c_q W_qb  -> [H, N | R]
[c_kv | k_pe] = x W_kva; c_kv = RMSNorm(c_kv); k_pe = rope(k_pe), one head shared by all heads
[k_nope | v] = c_kv W_kvb per head; scores = (q_nope.k_nope + q_pe.k_pe) * softmax_scale

Expanded form (no cache: training): k_nope and v per head from c_kv, causal attention over the call.
With a cache, a call of EXPANDED_MIN_WIDTH tokens or more (a prompt chunk: DeepSeek's prefill) runs
the expanded form too: its own keys and values as in training, the cached prefix's expanded from the
latent a block at a time, the two softmaxes merged by log-sum-exp (`expanded_chunk`).
Absorbed form (with a latent cache and fewer tokens: decode, speculative verify; DeepSeek-V3
section 2.1.1): with k_nope[h] = W_uk[h] c and v[h] = W_uv[h] c,
  q_nope[h] . k_nope[h] = (W_uk[h]^T q_nope[h]) . c = q_lat[h] . c
  sum_s p_s v_s[h] = W_uv[h] (sum_s p_s c_s) = W_uv[h] o_lat[h]
so a call reads only the cached c [S, C] and k_pe [S, R], never per-head keys or values.

DeepSeek Sparse Attention (V3.2, `cfg.has_indexer`): the lightning indexer (model/indexer.py) scores
every visible key per query and the expanded form attends only to each query's `index_topk` best
(the causal mask narrowed, the reference form); a query with at most `index_topk` visible keys
keeps them all, so a call of at most `index_topk` tokens runs dense attention (the indexer is not
run unless its terms are asked for) and its result is dense attention's exactly. A dense
warm-up is the same model with `index_topk` at least the sequence length. Through the latent cache
(prefill chunks, decode: `sparse_cached`) the indexer's keys are cached beside the latent, the
queries' top-k is taken over the cached keys and the call's own, and the absorbed form attends
over the gathered latent rows only (B x T x index_topk of them, whatever the cache length). On a
paged cache the index keys share the latent's pages: the top-k is taken over each row's own keys
read through its page table and the chosen rows are gathered through it.

Hook for training the indexer: `expanded(..., indexer_terms=True)` returns (out, `IndexerTerms`):
the indexer's logits [B, T, S] (float32, -inf off the causal, same-document keys), the main
attention's probabilities summed over the H heads [B, T, S] (float32, each row sums to H; zero off
the keys attended) and the keys selected, for the KL loss from the latter (normalised) to
softmax(logits) over the selected keys (`indexer.indexer_kl`). The indexer reads its inputs detached
(`stop_gradient`, the same values): only its own loss trains it, and that loss only it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import lora, page_shards, params
from dsv3_jax.model.indexer import Indexer, cached_topk, select_topk
from dsv3_jax.model.norm import RMSNorm
from dsv3_jax.model.rope import apply_rope
from dsv3_jax.ops import latent_attention
from dsv3_jax.ops.attention import attention as xla_attention, causal_attention_lse, causal_mask, head_summed_probs
from dsv3_jax.ops.linear import project
from dsv3_jax.ops.quant import as_dense

# Calls of this many tokens or more attend through the expanded form even with a cache (prompt
# chunks: per-head keys of N + R dims and values of V dims cost fewer flops a score than the
# absorbed form's C + R and C once W queries share them); fewer (decode, verify) absorb, which never
# expands the cache. Both are the same function; prefill.MIN_WIDTH chunks are at least this wide.
EXPANDED_MIN_WIDTH = 16


class LatentCache(NamedTuple):
    """MLA's cache: normalised latent and roped key per token, indexed by position (slot s holds
    position s). Arrays are [B, S, ...] for one layer, [L, B, S, ...] for a layer stack, or
    [B, W, ...] for the entries one call writes. A paged cache holds a pool of pages instead,
    [(L,) N, K, ...], read through a page table [B, M]: row b's slot s is page table[b, s // K],
    offset s % K. The dtypes are the cache layout
    (`dsv3_jax.inference.cache`); a float8 latent comes with its per-128 scales, an int8 latent
    with one scale per token. A model with the lightning indexer also caches its key per token."""

    latent: jax.Array  # [(L,) B, S, C] float32 | bfloat16 | float8_e4m3fn | int8
    latent_scale: jax.Array | None  # [(L,) B, S, G] float32: G = ceil(C / 128) for float8, 1 for int8; else None
    k_pe: jax.Array  # [(L,) B, S, R] float32 | bfloat16
    index_k: jax.Array | None = None  # [(L,) B, S, K] the indexer's keys (V3.2), in the cache dtype; else None
    index_k_scale: jax.Array | None = None  # [(L,) B, S, 1] float32 for float8 / int8 index keys; else None

    @property
    def cache_dtype(self) -> str:
        if self.latent_scale is None or self.latent.dtype == jnp.int8:
            return jnp.dtype(self.latent.dtype).name
        return "float8"

    def write(self, entries: LatentCache, positions_BxW: jax.Array, layer=None, page_table=None) -> LatentCache:
        """This cache with `entries` [B, W, ...] stored at slots `positions` (of `layer` if stacked;
        `layer=slice(None)`: a whole stack's entries [L, B, W, ...] in one scatter); with a
        `page_table` [B, M] into its pages, an entry whose page is -1 (none) or past the table (as past
        a contiguous cache's slots) not at all; on a mesh each batch shard writes its own pages (`page_shards`)."""
        if page_table is not None:
            return page_shards.write(LatentCache._scatter, self, page_table, layer, entries, positions_BxW)
        return self._scatter(None, layer, entries, positions_BxW)

    def _scatter(self, page_table, layer, entries: LatentCache, positions_BxW: jax.Array) -> LatentCache:
        index = latent_attention.cache_index(positions_BxW, page_table, self.latent.shape[-3:-1])
        index = index if layer is None else (layer, *index)
        return LatentCache(*(None if a is None else a.at[index].set(e) for a, e in zip(self, entries)))


class IndexerTerms(NamedTuple):
    """What training the lightning indexer needs from one layer (see the module docstring)."""

    logits: jax.Array  # float32 [B, T, S] the indexer's, -inf where not visible
    attn_probs: jax.Array  # float32 [B, T, S] the main attention's probabilities summed over heads
    selected: jax.Array  # bool [B, T, S] the keys each query attends to (the indexer's top-k)


def _attention_fn(impl: str, with_lse: bool = False):
    """Causal attention within a call: (q, k, v, softmax_scale=) -> out, or (out, lse [B, T, H])."""
    if impl == "pallas":
        return functools.partial(pallas_kernels.mla_prefill, return_lse=True) if with_lse else pallas_kernels.mla_prefill
    return causal_attention_lse if with_lse else xla_attention


class MLA(nnx.Module):
    LORA_TARGETS = {"wq": 1, "wq_a": 1, "wq_b": 1, "wkv_a": 1, "wkv_b": 1, "wo": 2}  # weight: contracted axes

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, std, pd = cfg.hidden_size, cfg.num_heads, cfg.initializer_range, cfg.param_dtype
        if cfg.q_lora_rank is None:
            self.wq = params.normal(rngs, (d, h, cfg.qk_head_dim), ("embed", "heads", "head_dim"), std=std, dtype=pd)
        else:
            self.wq_a = params.normal(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), std=std, dtype=pd)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps, axis_name="q_lora", param_dtype=pd)
            self.wq_b = params.normal(rngs, (cfg.q_lora_rank, h, cfg.qk_head_dim), ("q_lora", "heads", "head_dim"),
                                      std=std, dtype=pd)
        self.wkv_a = params.normal(rngs, (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), ("embed", "kv_lora"),
                                   std=std, dtype=pd)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_norm_eps, axis_name="kv_lora", param_dtype=pd)
        self.wkv_b = params.normal(rngs, (cfg.kv_lora_rank, h, cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   ("kv_lora", "heads", "head_dim"), std=std, dtype=pd)
        self.wo = params.normal(rngs, (h, cfg.v_head_dim, d), ("heads", "head_dim", "embed"), std=std, dtype=pd)
        if cfg.has_indexer:
            self.indexer = Indexer(cfg, rngs=rngs)

    def _mm(self, eq: str, x: jax.Array, name: str) -> jax.Array:
        """x's trailing axes contracted with the leading ones of weight `name` (plus its LoRA
        adapter, if any), as the einsum `eq` spells out."""
        lhs, out = eq.split("->")
        x_axes, w_axes = lhs.split(",")
        contract = len(set(x_axes) & set(w_axes) - set(out))
        return project(x, getattr(self, name)[...], contract=contract, compute_dtype=self.cfg.compute_dtype,
                       fp8=self.cfg.fp8_matmul, lora=lora.pair(self, name))

    def query_latent(self, x_BxTxD: jax.Array) -> jax.Array:
        """c_q = RMSNorm(x W_qa) [B, T, Q] (with q_lora_rank)."""
        return self.q_norm(self._mm("BTD,DQ->BTQ", x_BxTxD, "wq_a"))

    def query(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q_nope [B, T, H, N] and the roped q_pe [B, T, H, R]."""
        if self.cfg.q_lora_rank is None:
            q = self._mm("BTD,DHK->BTHK", x_BxTxD, "wq")
        else:
            q = self._mm("BTQ,QHK->BTHK", self.query_latent(x_BxTxD), "wq_b")
        q_nope, q_pe = jnp.split(q, [self.cfg.qk_nope_head_dim], axis=-1)
        return q_nope, apply_rope(q_pe, cos, sin, interleave=self.cfg.rope_interleave)

    def latent(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What the decode cache stores: normalised latent [B, T, C] and roped key [B, T, R]."""
        kv_a = self._mm("BTD,DC->BTC", x_BxTxD, "wkv_a")
        c_kv, k_pe = jnp.split(kv_a, [self.cfg.kv_lora_rank], axis=-1)
        return self.kv_norm(c_kv), apply_rope(k_pe, cos, sin, interleave=self.cfg.rope_interleave)

    def __call__(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array | None = None,
                 *, cache: LatentCache | None = None, positions: jax.Array | None = None, layer=None,
                 page_table: jax.Array | None = None):
        """x [B, T, D], cos/sin [B, T, R/2], segment_ids [B, T] or None -> [B, T, D] (expanded form).

        With `cache` (one layer [B, S, ...], or a stack [L, B, S, ...] read at `layer`; with a
        `page_table` [B, M] a pool of pages) and the tokens' `positions` [B, T] (consecutive per row):
        the absorbed form over the cache slots before `positions` plus this call's own entries.
        Returns (out [B, T, D], the entries [B, T, ...] to store at `positions`).
        """
        if cache is not None and self.cfg.has_indexer:
            return self.sparse_cached(x_BxTxD, cos, sin, cache, positions, layer, page_table)
        if cache is not None and x_BxTxD.shape[1] >= EXPANDED_MIN_WIDTH:
            return self.expanded_chunk(x_BxTxD, cos, sin, cache, positions, layer, page_table)
        if cache is not None:
            return self.absorbed(x_BxTxD, cos, sin, cache, positions, layer, page_table=page_table)
        return self.expanded(x_BxTxD, cos, sin, segment_ids)

    def _qkv(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array):
        """Per-head q, k [B, T, H, N + R] and v [B, T, H, V] expanded from the call's latent, and the
        latent itself (c_kv [B, T, C], roped k_pe [B, T, R])."""
        cfg = self.cfg
        q_nope, q_pe = self.query(x_BxTxD, cos, sin)
        c_kv, k_pe = self.latent(x_BxTxD, cos, sin)
        k_nope, v = jnp.split(self._mm("BSC,CHK->BSHK", c_kv, "wkv_b"), [cfg.qk_nope_head_dim], axis=-1)
        k_pe_BxSxHxR = jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], cfg.qk_rope_head_dim))
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        k = jnp.concatenate([k_nope, k_pe_BxSxHxR], axis=-1)
        return q, k, v, (c_kv, k_pe)

    def expanded(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array | None = None,
                 *, indexer_terms: bool = False):
        """Causal attention with per-head keys and values expanded from the latent -> [B, T, D]; with
        an indexer, over each query's selected keys only (through the jnp attention whatever
        `attention_impl`), and with `indexer_terms` -> (out, IndexerTerms)."""
        cfg = self.cfg
        q, k, v, _ = self._qkv(x_BxTxD, cos, sin)
        every_key_kept = x_BxTxD.shape[1] <= cfg.index_topk  # the selection would keep each visible key
        if not cfg.has_indexer or every_key_kept and not indexer_terms:
            out = _attention_fn(cfg.attention_impl)(q, k, v, softmax_scale=cfg.softmax_scale, segment_ids=segment_ids)
            return self._mm("BTHV,HVD->BTD", out, "wo")
        visible = causal_mask(segment_ids, *x_BxTxD.shape[:2])
        detached = jax.lax.stop_gradient
        logits = self.indexer(detached(x_BxTxD), detached(self.query_latent(x_BxTxD)), cos, sin, visible)
        if every_key_kept:  # the dense warm-up's terms: the selection is every visible key, no top-k to sort
            keep = visible[:, 0]
            out = _attention_fn(cfg.attention_impl)(q, k, v, softmax_scale=cfg.softmax_scale, segment_ids=segment_ids)
        else:
            keep = select_topk(logits, cfg.index_topk)
            out = xla_attention(q, k, v, softmax_scale=cfg.softmax_scale, segment_ids=segment_ids, keep=keep)
        out = self._mm("BTHV,HVD->BTD", out, "wo")
        if not indexer_terms:
            return out
        probs = head_summed_probs(q, k, visible & keep[:, None], softmax_scale=cfg.softmax_scale)
        return out, IndexerTerms(logits, probs, keep)

    def expanded_chunk(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array, cache: LatentCache,
                       positions_BxT: jax.Array, layer=None, page_table=None) -> tuple[jax.Array, LatentCache]:
        """A prompt chunk at consecutive `positions`: causal attention over its own expanded keys and
        values (`attention_impl`) merged with attention over the cache slots before it, expanded from
        the cached latent block by block -> (out [B, T, D], the entries [B, T, ...] to store)."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        q, k, v, own = self._qkv(x_BxTxD, cos, sin)
        fresh, fresh_lse = _attention_fn(cfg.attention_impl, with_lse=True)(q, k, v, softmax_scale=cfg.softmax_scale)
        w_uk, w_uv = jnp.split(as_dense(lora.weight(self, "wkv_b"), dt), [cfg.qk_nope_head_dim], axis=-1)
        q_nope, q_pe = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)

        def prefix_attention(c, table, layer, q_nope, q_pe, positions_BxT, w_uk, w_uv):
            return latent_attention.attend_expanded(q_nope, q_pe, w_uk, w_uv, c, positions_BxT, layer=layer,
                                                    page_table=table, softmax_scale=cfg.softmax_scale, compute_dtype=dt)

        prefix, prefix_lse = page_shards.read(prefix_attention, cache, page_table, layer, q_nope, q_pe, positions_BxT,
                                              shared=(w_uk, w_uv), merge="lse")
        out = latent_attention.merge(prefix, prefix_lse, fresh, fresh_lse)
        entries = LatentCache(*latent_attention.encode(*own, cache.cache_dtype))
        return self._mm("BTHV,HVD->BTD", out.astype(dt), "wo"), entries

    def sparse_cached(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array, cache: LatentCache,
                      positions_BxT: jax.Array, layer=None, page_table=None) -> tuple[jax.Array, LatentCache]:
        """DeepSeek Sparse Attention through the cache (or, with a `page_table`, its pool of pages):
        each query attends to its `index_topk` best entries (`absorbed` over the gathered rows).
        While no query of the call sees more than `index_topk` tokens that is each of them, and the
        dense cached form runs instead (its result, to the rounding of the branch's own
        compilation). The entries to store carry the index keys too."""
        cfg = self.cfg
        if cache.index_k is None:
            raise ValueError("a model with the lightning indexer (index_n_heads > 0) needs a cache with its index "
                             "keys: build it with dsv3_jax.inference.init_cache for this config")
        own_index_k = self.indexer.keys(x_BxTxD, cos, sin)
        dense = self.expanded_chunk if x_BxTxD.shape[1] >= EXPANDED_MIN_WIDTH else self.absorbed
        run_dense = functools.partial(dense, x_BxTxD, cos, sin, cache, positions_BxT, layer, page_table=page_table)
        if latent_attention.row_slots(cache.latent, page_table) <= cfg.index_topk:  # no position past index_topk
            out, entries = run_dense()
        else:
            run_sparse = functools.partial(self.absorbed, x_BxTxD, cos, sin, cache, positions_BxT, layer, own_index_k,
                                           page_table=page_table)
            out, entries = jax.lax.cond(jnp.max(positions_BxT) < cfg.index_topk, run_dense, run_sparse)
        index_k, index_k_scale = latent_attention.encode_index_key(own_index_k, cache.cache_dtype)
        return out, entries._replace(index_k=index_k, index_k_scale=index_k_scale)

    def absorbed(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array, cache: LatentCache,
                 positions_BxT: jax.Array, layer=None, own_index_k: jax.Array | None = None, page_table=None
                 ) -> tuple[jax.Array, LatentCache]:
        """Queries in the latent space over the cache slots before `positions` and the call's own
        entries; with the call's index keys `own_index_k` [B, T, K], over each query's top-k only."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        q_nope, q_pe = self.query(x_BxTxD, cos, sin)
        own = self.latent(x_BxTxD, cos, sin)
        entries = LatentCache(*latent_attention.encode(*own, cache.cache_dtype))
        w_uk, w_uv = jnp.split(as_dense(lora.weight(self, "wkv_b"), dt), [cfg.qk_nope_head_dim], axis=-1)  # [C,H,N], [C,H,V]
        q_lat = jnp.einsum("BTHN,CHN->BTHC", q_nope.astype(dt), w_uk, preferred_element_type=jnp.float32)
        pallas = cfg.attention_impl == "pallas" and x_BxTxD.shape[1] == 1
        kw = dict(softmax_scale=cfg.softmax_scale, compute_dtype=dt)
        if own_index_k is None:
            attend = latent_attention.attend_pallas if pallas else latent_attention.attend
            o_lat = page_shards.read(lambda c, table, layer, q, p, o, pos: attend(q, p, c, o, pos, page_table=table,
                                                                                  layer=layer, **kw),
                                     cache, page_table, layer, q_lat, q_pe, own, positions_BxT)
        else:
            q_index, w_index = self.indexer.queries(x_BxTxD, self.query_latent(x_BxTxD), cos, sin)
            chosen = cached_topk(q_index, w_index, cache, own_index_k, positions_BxT, cfg.index_topk, layer=layer,
                                 pallas=pallas, page_table=page_table)
            if pallas:
                o_lat = page_shards.read(lambda c, table, layer, q, p, o, ch: latent_attention.attend_sparse_pallas(
                    q, p, c, o, ch, layer=layer, page_table=table, **kw), cache, page_table, layer, q_lat, q_pe, own,
                    chosen)
            else:
                rows = page_shards.read(lambda c, table, layer, ch: latent_attention.read_chosen(
                    c, layer, ch, dt, page_table=table), cache, page_table, layer, chosen, merge="sum")
                o_lat = latent_attention.attend_sparse(q_lat, q_pe, rows, own, chosen,
                                                       latent_attention.row_slots(cache.latent, page_table), **kw)
        out = jnp.einsum("BTHC,CHV->BTHV", o_lat.astype(dt), w_uv, preferred_element_type=jnp.float32)
        return self._mm("BTHV,HVD->BTD", out.astype(dt), "wo"), entries

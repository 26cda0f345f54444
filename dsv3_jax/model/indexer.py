"""DeepSeek-V3.2's lightning indexer: which keys each query's sparse attention reads (DSA).

Letters: B batch, T query length, S key length (cache slots), W a cached call's tokens, D model,
Q q_lora_rank, I index heads, K index head dim.

q_I = c_q W_q (c_q: MLA's normalised query latent); k = LayerNorm(x W_k), one key head shared by all
index heads; the first qk_rope_head_dim dims of both roped (halves paired, not interleaved);
w = x W_w / sqrt(I)
  logits[t, s] = sum_i w[t, i] * ReLU(q_i[t] . k[s] / sqrt(K))    (causal: -inf for s > t)
and query t attends to the `index_topk` keys of largest logit (all of its keys when it has fewer).
The top-k selection has no gradient: the indexer learns from its own loss, never through the main
model's (DeepSeek-V3.2 report, continued pre-training), per query t over its selected keys S_t
  L_I = sum_t KL(p_t || softmax(logits[t, S_t])),  p_t = sum_h attention_h[t, S_t] / H
(`indexer_kl`, a mean over queries). Its input is detached (MLA.expanded), so this loss trains the
indexer alone, and the target p carries no gradient either. With `index_topk` at least the sequence
length S_t is every visible key: the dense warm-up stage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import page_shards, params
from dsv3_jax.model.norm import LayerNorm
from dsv3_jax.model.rope import apply_rope
from dsv3_jax.ops.latent_attention import layer_slice, scores_over_pages
from dsv3_jax.ops.linear import project
import pallas_kernels


class Indexer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, n, k, std, pd = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim, cfg.initializer_range, cfg.param_dtype
        self.wq_b = params.normal(rngs, (cfg.q_lora_rank, n, k), ("q_lora", None, None), std=std, dtype=pd)
        self.wk = params.normal(rngs, (d, k), ("embed", None), std=std, dtype=pd)
        self.k_norm = LayerNorm(k, eps=1e-6, param_dtype=pd)
        self.weights_proj = params.normal(rngs, (d, n), ("embed", None), std=std, dtype=pd)

    def _rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        rot, rest = jnp.split(x, [self.cfg.qk_rope_head_dim], axis=-1)
        return jnp.concatenate([apply_rope(rot, cos, sin, interleave=False), rest], axis=-1)

    def queries(self, x_BxTxD: jax.Array, c_q_BxTxQ: jax.Array, cos: jax.Array, sin: jax.Array):
        """The index queries q [B, T, I, K] (roped) and their head weights w [B, T, I] float32."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        q_BxTxIxK = self._rope(project(c_q_BxTxQ, self.wq_b[...], contract=1, compute_dtype=dt), cos, sin)
        w_BxTxI = project(x_BxTxD, self.weights_proj[...], contract=1, compute_dtype=jnp.float32)
        return q_BxTxIxK, w_BxTxI * cfg.index_n_heads ** -0.5

    def keys(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """The index key k [B, T, K] (normed, roped): what the index-key cache stores."""
        dt = self.cfg.compute_dtype
        return self._rope(self.k_norm(project(x_BxTxD, self.wk[...], contract=1, compute_dtype=dt)), cos, sin)

    def __call__(self, x_BxTxD: jax.Array, c_q_BxTxQ: jax.Array, cos: jax.Array, sin: jax.Array,
                 visible_Bx1xTxS: jax.Array) -> jax.Array:
        """x [B, T, D], MLA's query latent c_q [B, T, Q], cos/sin [B, T, R/2], visible bool
        [B, 1, T, S] (causal, same document) -> float32 index logits [B, T, S], -inf where not visible."""
        q_BxTxIxK, w_BxTxI = self.queries(x_BxTxD, c_q_BxTxQ, cos, sin)
        logits = index_logits(q_BxTxIxK, w_BxTxI, self.keys(x_BxTxD, cos, sin))
        return jnp.where(visible_Bx1xTxS[:, 0], logits, -jnp.inf)


def index_logits(q_BxTxIxK: jax.Array, w_BxTxI: jax.Array, k_BxSxK: jax.Array) -> jax.Array:
    """sum_i w[t, i] * ReLU(q_i[t] . k[s] / sqrt(K)) -> float32 [B, T, S] (no mask)."""
    f32 = jnp.float32
    qk = jnp.einsum("BTIK,BSK->BTIS", q_BxTxIxK.astype(f32), k_BxSxK.astype(f32), preferred_element_type=f32)
    return jnp.einsum("BTI,BTIS->BTS", w_BxTxI, jax.nn.relu(qk * q_BxTxIxK.shape[-1] ** -0.5))


def select_topk(logits_BxTxS: jax.Array, topk: int) -> jax.Array:
    """bool [B, T, S]: the `topk` keys of largest logit per query (fewer keys than `topk`: all of
    them; -inf logits, i.e. invisible keys, are never kept)."""
    _, idx_BxTxk = jax.lax.top_k(jax.lax.stop_gradient(logits_BxTxS), min(topk, logits_BxTxS.shape[-1]))
    chosen = jnp.put_along_axis(jnp.zeros(logits_BxTxS.shape, bool), idx_BxTxk, True, axis=-1, inplace=False)
    return chosen & jnp.isfinite(logits_BxTxS)


def indexer_kl(logits_BxTxS: jax.Array, attn_probs_BxTxS: jax.Array, selected_BxTxS: jax.Array,
               query_mask_BxT: jax.Array | None) -> jax.Array:
    """[] mean over the queries of `query_mask` (None: all) of KL(p || softmax(logits)) over each
    query's selected keys: p the main attention's head-summed probabilities L1-normalised (no
    gradient), the indexer's logits renormalised over the same keys."""
    p = jax.lax.stop_gradient(attn_probs_BxTxS)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    log_q = jax.nn.log_softmax(jnp.where(selected_BxTxS, logits_BxTxS, -1e30), axis=-1)  # finite: no 0 * inf
    log_p = jnp.log(jnp.where(p > 0, p, 1.0))
    kl_BxT = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)
    m = jnp.ones(kl_BxT.shape, jnp.float32) if query_mask_BxT is None else query_mask_BxT.astype(jnp.float32)
    return jnp.sum(kl_BxT * m) / jnp.maximum(jnp.sum(m), 1.0)


def cached_logits(q_BxWxIxK: jax.Array, w_BxWxI: jax.Array, cache, positions_BxW: jax.Array, *, layer=None,
                  pallas: bool = False, page_table=None) -> jax.Array:
    """The W queries' logits over the cache's index keys (`cache.index_k` of `layer`, [B, S, K]; with
    a `page_table` [B, M] a pool of pages, S = M x K) -> float32 [B, W, S], the caller masking the
    slots at and past each row's first position. Through pages only the pages before each row's
    position are read (`scores_over_pages`: the cost follows the rows' lengths, not M x K); a slot
    not read scores 0, so a read on every shard of rows whole sums. `pallas` (one query per row):
    the indexer kernel's scores."""
    before_B = positions_BxW[:, 0]

    def score(keys_BxSxK, scale_BxSx1, rows=slice(None), start=0):
        if pallas:
            w_fold_BxI = w_BxWxI[rows, 0] * q_BxWxIxK.shape[-1] ** -0.5  # ReLU(a x) = a ReLU(x), a > 0
            return pallas_kernels.indexer_scores(q_BxWxIxK[rows, 0], w_fold_BxI, keys_BxSxK, before_B[rows] - start,
                                                 k_scale=scale_BxSx1)[:, None]
        keys = keys_BxSxK.astype(jnp.float32) if scale_BxSx1 is None else keys_BxSxK.astype(jnp.float32) * scale_BxSx1
        return index_logits(q_BxWxIxK[rows], w_BxWxI[rows], keys)

    if page_table is None:
        return score(*(layer_slice(a, layer) for a in (cache.index_k, cache.index_k_scale)))
    return scores_over_pages(score, cache.index_k, cache.index_k_scale, page_table, before_B, q_BxWxIxK.shape[1],
                             layer=layer)


def cached_topk(q_BxWxIxK: jax.Array, w_BxWxI: jax.Array, cache, own_k_BxWxK: jax.Array, positions_BxW: jax.Array,
                topk: int, *, layer=None, pallas: bool = False, page_table=None) -> jax.Array:
    """The `topk` entries of largest logit for a cached call's W queries at consecutive `positions`,
    over the cache slots before the call (`cached_logits`; on a mesh each batch shard reads its own
    pages, `page_shards`) and the call's own exact keys up to each query -> int32
    [B, W, min(topk, S + W)]: j < S is cache slot j, S + w the call's own entry w, -1 none (fewer
    visible)."""
    def logits(c, table, layer, q, w, positions):
        return cached_logits(q, w, c, positions, layer=layer, pallas=pallas, page_table=table)

    cached_BxWxS = page_shards.read(logits, cache, page_table, layer, q_BxWxIxK, w_BxWxI, positions_BxW, merge="sum")
    visible_Bx1xS = jnp.arange(cached_BxWxS.shape[-1]) < positions_BxW[:, :1, None]
    cached_BxWxS = jnp.where(visible_Bx1xS, cached_BxWxS, -jnp.inf)
    own_visible_BxWxW = positions_BxW[:, None, :] <= positions_BxW[:, :, None]
    own_BxWxW = jnp.where(own_visible_BxWxW, index_logits(q_BxWxIxK, w_BxWxI, own_k_BxWxK), -jnp.inf)
    logits = jnp.concatenate([cached_BxWxS, own_BxWxW], axis=-1)
    best, idx = jax.lax.top_k(logits, min(topk, logits.shape[-1]))
    return jnp.where(jnp.isfinite(best), idx, -1)

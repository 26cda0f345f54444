"""MTP speculative decoding: the MTP depths draft (`mtp_draft`), the main model verifies all drafts in
one step (`accept`).

Letters: B batch, K = 1 + M tokens verified per step, M drafts (one per MTP depth), W window, N >= W + M
next-token columns, D model, V vocab.

A step feeds [t_n, d_1, ..., d_M] at positions n .. n+M. Output i of the main model is the target
distribution p_i of the token at n+i+1. Draft d_{i+1} is accepted while every earlier one was:
greedily when it equals argmax p_i; when sampling, with probability p_i(d_{i+1}) (the drafts are
the MTP's argmax, a point mass q, so min(1, p/q) = p), and on rejection the replacement is drawn
from p_i without d_{i+1}. The emitted tokens therefore follow the target distribution exactly,
and greedy output equals plain greedy decoding token for token. After a accepted drafts the step
emits a + 1 tokens; cache slots past them hold rejected entries that later steps overwrite.

The rule is `accept`, once, for `generate()` and the serving engine alike: every row has its own
sampling parameters and key (`sampling.Draw`); the step (`steps.decode_step`) chooses the keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv3_jax.inference.sampling import Draw, RowSampling, filtered_logits
from dsv3_jax.model import ModelCache


def mtp_draft(model, cache: ModelCache, h_BxWxD: jax.Array, next_tokens_BxN: jax.Array, positions_BxW: jax.Array,
              last_B: jax.Array, active_B: jax.Array | None = None) -> tuple[jax.Array, ModelCache]:
    """Runs the MTP depths over a window and drafts one token per depth from window index `last`.

    Depth k (1-based) at window index j reads h^{k-1}_j and the token at position p_j + k, taken from
    `next_tokens` (t_{p_j + 1} at column j, N >= W + M columns: a prefill chunk passes the prompt
    beyond it) with the drafts of shallower depths written in at last + k. Returns (drafts int32
    [B, M], cache); depth k's entries at j > last - k + 1 used drafted tokens (they stay in the
    cache: that can lower acceptance at depth >= 2, never change the verified output).
    """
    num_depths = cache.mtp.latent.shape[0]
    b, w = positions_BxW.shape
    rows, ext, h, drafts = jnp.arange(b), next_tokens_BxN, h_BxWxD, []
    for k in range(num_depths):
        h, cache = model.mtp_depth(k, h, jax.lax.dynamic_slice_in_dim(ext, k, w, axis=1), positions_BxW, cache)
        draft = jnp.argmax(model.logits(h[rows, last_B]), axis=-1).astype(jnp.int32)
        keep = ext[rows, last_B + k + 1]
        ext = ext.at[rows, last_B + k + 1].set(draft if active_B is None else jnp.where(active_B, draft, keep))
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), cache


def accept(logits_BxKxV: jax.Array, drafts_BxM: jax.Array, d: Draw) -> tuple[jax.Array, jax.Array]:
    """The acceptance rule, every row with its own sampling parameters and key (the module docstring).

    -> (emitted int32 [B, K], accepted int32 [B]); tokens emitted[b, :accepted[b] + 1] are kept.
    """
    b, k, v = logits_BxKxV.shape
    drafts_BxK = jnp.concatenate([drafts_BxM, jnp.zeros((b, 1), jnp.int32)], axis=1)
    target = jnp.argmax(logits_BxKxV, axis=-1).astype(jnp.int32)
    ok_BxM, replacement = drafts_BxM == target[:, :-1], target
    if not d.greedy:
        s = d.rows
        per_token = RowSampling(*(jnp.repeat(a, k) for a in s.scalars()))
        top_k, top_p = d.filters
        p = jax.nn.softmax(filtered_logits(logits_BxKxV.reshape(b * k, v), per_token, top_k=top_k, top_p=top_p),
                           axis=-1)
        p = p.reshape(b, k, v)
        keys = jax.vmap(jax.random.split)(d.keys)  # [B, 2]: accept, resample
        p_draft = jnp.take_along_axis(p[:, :-1], drafts_BxM[..., None], axis=-1)[..., 0]
        u = jax.vmap(lambda key: jax.random.uniform(key, (k - 1,)))(keys[:, 0])
        sampled = s.temperature[:, None] > 0
        ok_BxM = jnp.where(sampled, u < p_draft, ok_BxM)
        is_draft = jax.nn.one_hot(drafts_BxK, v, dtype=bool) & (jnp.arange(k) < k - 1)[None, :, None]
        residual = jnp.where(is_draft, 0.0, p)  # the last position has no draft: plain p
        drawn = jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r), axis=-1))(keys[:, 1], residual)
        replacement = jnp.where(sampled, drawn, target).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(ok_BxM.astype(jnp.int32), axis=1), axis=1)
    emitted = jnp.where(jnp.arange(k)[None] < accepted[:, None], drafts_BxK, replacement)
    return emitted, accepted

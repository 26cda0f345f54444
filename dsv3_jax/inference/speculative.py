"""MTP speculative decoding: the MTP depths draft, the main model verifies all drafts in one step.

Letters: B batch, K = 1 + M tokens verified per step, M drafts (one per MTP depth), V vocab.

A step feeds [t_n, d_1, ..., d_M] at positions n .. n+M. Output i of the main model is the target
distribution p_i of the token at n+i+1. Draft d_{i+1} is accepted while every earlier one was:
greedily when it equals argmax p_i; when sampling, with probability p_i(d_{i+1}) (the drafts are
the MTP's argmax, a point mass q, so min(1, p/q) = p), and on rejection the replacement is drawn
from p_i without d_{i+1}. The emitted tokens therefore follow the target distribution exactly,
and greedy output equals plain greedy decoding token for token. After a accepted drafts the step
emits a + 1 tokens; cache slots past them hold rejected entries that later steps overwrite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv3_jax.inference.decode import model_step, mtp_draft
from dsv3_jax.inference.sampling import SamplingConfig, probabilities
from dsv3_jax.model import ModelCache


def accept(logits_BxKxV: jax.Array, drafts_BxM: jax.Array, key: jax.Array, cfg: SamplingConfig
           ) -> tuple[jax.Array, jax.Array]:
    """-> (emitted int32 [B, K], accepted int32 [B]); tokens emitted[b, :accepted[b] + 1] are kept."""
    b, k, _ = logits_BxKxV.shape
    drafts_BxK = jnp.concatenate([drafts_BxM, jnp.zeros((b, 1), jnp.int32)], axis=1)
    if cfg.greedy:
        target = jnp.argmax(logits_BxKxV, axis=-1).astype(jnp.int32)
        ok_BxM = drafts_BxM == target[:, :-1]
        replacement = target
    else:
        accept_key, resample_key = jax.random.split(key)
        p = probabilities(logits_BxKxV, cfg)
        p_draft = jnp.take_along_axis(p[:, :-1], drafts_BxM[..., None], axis=-1)[..., 0]
        ok_BxM = jax.random.uniform(accept_key, drafts_BxM.shape) < p_draft
        is_draft = jax.nn.one_hot(drafts_BxK, p.shape[-1], dtype=bool) & (jnp.arange(k) < k - 1)[None, :, None]
        residual = jnp.where(is_draft, 0.0, p)  # the last position has no draft: plain p
        replacement = jax.random.categorical(resample_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(ok_BxM.astype(jnp.int32), axis=1), axis=1)
    emitted = jnp.where(jnp.arange(k)[None] < accepted[:, None], drafts_BxK, replacement)
    return emitted, accepted


def step(model, cache: ModelCache, tokens_BxK, positions_B, key, *, sampling: SamplingConfig):
    """Verify [t_n, drafts] at n = positions, then draft again from the last kept token.

    Returns (emitted [B, K], accepted [B], next step's tokens [B, K], cache); the next step starts at
    position n + accepted + 1.
    """
    b, k = tokens_BxK.shape
    positions_BxK = positions_B[:, None] + jnp.arange(k, dtype=jnp.int32)
    out = model_step(model, cache, tokens_BxK, positions_BxK)
    emitted, accepted = accept(out.logits, tokens_BxK[:, 1:], key, sampling)
    # emitted[:, i] is the token at n + i + 1 for i <= accepted: exactly the MTP's next-token input.
    next_tokens = jnp.concatenate([emitted, jnp.zeros((b, k - 1), jnp.int32)], axis=1)
    drafts, cache = mtp_draft(model, out.cache, out.hidden, next_tokens, positions_BxK, accepted)
    last = emitted[jnp.arange(b), accepted]
    return emitted, accepted, jnp.concatenate([last[:, None], drafts], axis=1), cache

"""MTP speculative decoding: the MTP depths draft, the main model verifies all drafts in one step.

Letters: B batch, K = 1 + M tokens verified per step, M drafts (one per MTP depth), V vocab.

A step feeds [t_n, d_1, ..., d_M] at positions n .. n+M. Output i of the main model is the target
distribution p_i of the token at n+i+1. Draft d_{i+1} is accepted while every earlier one was:
greedily when it equals argmax p_i; when sampling, with probability p_i(d_{i+1}) (the drafts are
the MTP's argmax, a point mass q, so min(1, p/q) = p), and on rejection the replacement is drawn
from p_i without d_{i+1}. The emitted tokens therefore follow the target distribution exactly,
and greedy output equals plain greedy decoding token for token. After a accepted drafts the step
emits a + 1 tokens; cache slots past them hold rejected entries that later steps overwrite.

The rule is `accept_rows`, once, for `generate()` and the serving engine alike: every row has its
own sampling parameters (`sampling.RowSampling`) and key. `accept` (generate(): one config, keys
split from the step's key) and `accept_slots` (the engine: keys from each request's seed and
position) only choose the keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv3_jax.inference.decode import model_step, mtp_draft
from dsv3_jax.inference.sampling import RowSampling, SamplingConfig, filtered_logits, row_keys
from dsv3_jax.model import ModelCache


def accept_rows(logits_BxKxV: jax.Array, drafts_BxM: jax.Array, s: RowSampling, keys_B: jax.Array, *,
                greedy_only: bool = False, **filters) -> tuple[jax.Array, jax.Array]:
    """The acceptance rule, every row with its own sampling parameters and key (the module docstring).

    -> (emitted int32 [B, K], accepted int32 [B]); tokens emitted[b, :accepted[b] + 1] are kept.
    `greedy_only`: no row samples (known when tracing; skips the distributions). `filters`: as
    `sampling.filtered_logits`.
    """
    b, k, v = logits_BxKxV.shape
    drafts_BxK = jnp.concatenate([drafts_BxM, jnp.zeros((b, 1), jnp.int32)], axis=1)
    target = jnp.argmax(logits_BxKxV, axis=-1).astype(jnp.int32)
    ok_BxM, replacement = drafts_BxM == target[:, :-1], target
    if not greedy_only:
        per_token = RowSampling(*(jnp.repeat(a, k) for a in s.scalars()))
        p = jax.nn.softmax(filtered_logits(logits_BxKxV.reshape(b * k, v), per_token, **filters), axis=-1)
        p = p.reshape(b, k, v)
        keys = jax.vmap(jax.random.split)(keys_B)  # [B, 2]: accept, resample
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


def accept_slots(logits_BxKxV: jax.Array, drafts_BxM: jax.Array, s: RowSampling, positions_B: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """The engine's: row b keyed by (its request's seed, the position after its last token)."""
    return accept_rows(logits_BxKxV, drafts_BxM, s, row_keys(s.seed, positions_B + 1))


def accept(logits_BxKxV: jax.Array, drafts_BxM: jax.Array, key: jax.Array, cfg: SamplingConfig
           ) -> tuple[jax.Array, jax.Array]:
    """generate()'s: one `cfg` for every row, the rows keyed by splitting `key`."""
    b = logits_BxKxV.shape[0]
    return accept_rows(logits_BxKxV, drafts_BxM, cfg.rows(b), jax.random.split(key, b), greedy_only=cfg.greedy,
                       **cfg.filters)


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

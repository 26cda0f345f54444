"""Acceptance of MTP drafts with per-row sampling parameters (the rule of
`dsv3_jax.inference.speculative.accept`, with the scalars of one request per row).

Letters: B batch (slots), K = 1 + M tokens verified per step, M drafts, V vocab.

Greedy rows accept a draft while it equals the target argmax, so their output is plain greedy
decoding token for token. Sampled rows accept draft d_{i+1} with probability p_i(d_{i+1}) (the
drafts are the MTP's argmax, a point mass) and on rejection draw from p_i without d_{i+1}: the
emitted tokens follow each row's filtered target distribution exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv3_jax.serving.sampling import RowSampling, filtered_logits, row_keys


def accept_rows(logits_BxKxV: jax.Array, drafts_BxM: jax.Array, s: RowSampling, positions_B: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """-> (emitted int32 [B, K], accepted int32 [B]); tokens emitted[b, :accepted[b] + 1] are kept."""
    b, k, v = logits_BxKxV.shape
    drafts_BxK = jnp.concatenate([drafts_BxM, jnp.zeros((b, 1), jnp.int32)], axis=1)
    target = jnp.argmax(logits_BxKxV, axis=-1).astype(jnp.int32)
    per_token = RowSampling(*(jnp.repeat(a, k) for a in s.scalars()[:4]))  # penalties: already in the logits
    p = jax.nn.softmax(filtered_logits(logits_BxKxV.reshape(b * k, v), per_token), axis=-1).reshape(b, k, v)
    keys = jax.vmap(jax.random.split)(row_keys(s.seed, positions_B + 1))  # [B, 2]
    p_draft = jnp.take_along_axis(p[:, :-1], drafts_BxM[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k - 1,)))(keys[:, 0])
    sampled = s.temperature[:, None] > 0
    ok_BxM = jnp.where(sampled, u < p_draft, drafts_BxM == target[:, :-1])
    is_draft = jax.nn.one_hot(drafts_BxK, v, dtype=bool) & (jnp.arange(k) < k - 1)[None, :, None]
    residual = jnp.where(is_draft, 0.0, p)  # the last position has no draft: plain p
    drawn = jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r), axis=-1))(keys[:, 1], residual)
    replacement = jnp.where(sampled, drawn, target).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(ok_BxM.astype(jnp.int32), axis=1), axis=1)
    emitted = jnp.where(jnp.arange(k)[None] < accepted[:, None], drafts_BxK, replacement)
    return emitted, accepted

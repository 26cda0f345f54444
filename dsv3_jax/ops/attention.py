"""Causal (document-aware) softmax attention in plain jnp: the XLA path and the kernels' reference.

Letters: B batch, T query length, S key length, H heads, K q/k head dim, V value head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mask(segment_ids_BxT: jax.Array | None, batch: int, length: int) -> jax.Array:
    """bool [B, 1, T, S]: key s is visible from query t if s <= t and both lie in one document."""
    mask = jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]
    if segment_ids_BxT is None:
        return jnp.broadcast_to(mask, (batch, 1, length, length))
    same_doc = segment_ids_BxT[:, None, :, None] == segment_ids_BxT[:, None, None, :]
    return mask & same_doc


def attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxV, *, softmax_scale: float,
              segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention; scores and softmax in fp32, output in q's dtype. Returns [B, T, H, V]."""
    batch, length = q_BxTxHxK.shape[:2]
    scores = jnp.einsum("BTHK,BSHK->BHTS", q_BxTxHxK, k_BxSxHxK, preferred_element_type=jnp.float32)
    scores = jnp.where(causal_mask(segment_ids, batch, length), scores * softmax_scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BHTS,BSHV->BTHV", probs.astype(v_BxSxHxV.dtype), v_BxSxHxV,
                     preferred_element_type=jnp.float32)
    return out.astype(q_BxTxHxK.dtype)

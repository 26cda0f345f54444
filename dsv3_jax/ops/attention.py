"""Causal (document-aware) softmax attention in plain jnp: the XLA path and the kernels' reference.

Letters: B batch, T query length, S key length, H heads, K q/k head dim, V value head dim.

`attention` saves only q, k, v, the output and the [B, H, T] log-normaliser for its backward and
recomputes the probabilities there (the flash-attention backward, tiled by query rows only):
    P = exp(S - lse), dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = dS K, dK = dS^T Q.
Autodiff of the plain form would keep the fp32 [B, H, T, S] probabilities of every layer until the
backward pass; this keeps O(B T H) per layer. Both passes go `CAUSAL_BLOCK` query rows at a time,
each block against the keys up to its last row only (no online softmax is needed: a block sees every
key it may see), so the score tiles above the diagonal are never computed: 3 of 4 at 2 blocks,
(n + 1) / 2n at n. `attention_reference` is the plain form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

CAUSAL_BLOCK = 128  # query rows per block of `causal_attention_lse` (keys past a block's last row are skipped)


def causal_mask(segment_ids_BxT: jax.Array | None, batch: int, length: int) -> jax.Array:
    """bool [B, 1, T, S]: key s is visible from query t if s <= t and both lie in one document."""
    mask = jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]
    if segment_ids_BxT is None:
        return jnp.broadcast_to(mask, (batch, 1, length, length))
    same_doc = segment_ids_BxT[:, None, :, None] == segment_ids_BxT[:, None, None, :]
    return mask & same_doc


def _heads_first(x_BxTxHxK: jax.Array) -> jax.Array:
    return jnp.transpose(x_BxTxHxK, (0, 2, 1, 3))


def attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxV, *, softmax_scale: float,
              segment_ids: jax.Array | None = None, keep: jax.Array | None = None,
              block: int = CAUSAL_BLOCK) -> jax.Array:
    """Causal attention (S = T); scores and softmax in fp32, output in q's dtype. Returns [B, T, H, V].
    `keep` bool [B, T, S] (sparse attention: the keys each query's indexer selected) narrows the
    causal mask further.

    Computed heads-first ([B, H, T, K]): every einsum is then a plain batched matmul over (B, H),
    and XLA:CPU transposes each operand once here instead of inside each of the five dots
    (docs/benchmarks.md, Kernel choices). Query rows go
    `block` at a time (module docstring)."""
    batch, length = q_BxTxHxK.shape[:2]
    mask = causal_mask(segment_ids, batch, length)
    if keep is not None:
        mask = mask & keep[:, None]
    out_BxHxTxV = _attention(_heads_first(q_BxTxHxK), _heads_first(k_BxSxHxK), _heads_first(v_BxSxHxV),
                             mask, softmax_scale, block)
    return _heads_first(out_BxHxTxV)


def _query_blocks(length: int, block: int) -> list[tuple[int, int]]:
    """[start, end) of each block of query rows; block b attends keys [0, end_b)."""
    return [(start, min(start + block, length)) for start in range(0, length, block)]


def causal_attention_lse(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, *, softmax_scale: float,
                         block: int = CAUSAL_BLOCK) -> tuple[jax.Array, jax.Array]:
    """Forward only: causal attention within one call and its log-normaliser -> (out [B, T, H, V]
    in q's dtype, lse [B, T, H] float32), for merging with attention over keys held elsewhere (a
    prefill chunk's cached prefix, `latent_attention.attend_expanded`).

    Queries go `block` rows at a time, each block against the keys up to its last row only: a
    512-token chunk computes 10 of the 16 [128, 128] score tiles that the square would."""
    batch, length = q_BxTxHxK.shape[:2]
    q, k, v = _heads_first(q_BxTxHxK), _heads_first(k_BxTxHxK), _heads_first(v_BxTxHxV)
    out_BxHxTxV, (*_, lse_BxHxTx1) = _attention_fwd(q, k, v, causal_mask(None, batch, length), softmax_scale, block)
    return _heads_first(out_BxHxTxV), jnp.transpose(lse_BxHxTx1[..., 0], (0, 2, 1))


def attention_reference(q_BxTxHxK, k_BxSxHxK, v_BxSxHxV, *, softmax_scale: float,
                        segment_ids: jax.Array | None = None) -> jax.Array:
    """The same function by plain autodiff-able jnp (jax.nn.softmax), for tests."""
    probs = _probs(q_BxTxHxK, k_BxSxHxK, causal_mask(segment_ids, *q_BxTxHxK.shape[:2]), softmax_scale)
    out = jnp.einsum("BHTS,BSHV->BTHV", probs.astype(v_BxSxHxV.dtype), v_BxSxHxV, preferred_element_type=jnp.float32)
    return out.astype(q_BxTxHxK.dtype)


def head_summed_probs(q_BxTxHxK, k_BxSxHxK, mask_Bx1xTxS: jax.Array, *, softmax_scale: float) -> jax.Array:
    """float32 [B, T, S]: each head's attention probabilities under `mask`, summed over the heads
    (the main attention's distribution that DSA's indexer is trained towards)."""
    return jnp.sum(_probs(q_BxTxHxK, k_BxSxHxK, mask_Bx1xTxS, softmax_scale), axis=1)


def _probs(q_BxTxHxK, k_BxSxHxK, mask_Bx1xTxS, scale) -> jax.Array:
    """float32 [B, H, T, S]: softmax over the keys of the masked, scaled scores (the plain form)."""
    scores = jnp.einsum("BTHK,BSHK->BHTS", q_BxTxHxK, k_BxSxHxK, preferred_element_type=jnp.float32)
    return jax.nn.softmax(jnp.where(mask_Bx1xTxS, scores * scale, -jnp.inf), axis=-1)


def _scores(q_BxHxTxK, k_BxHxSxK, mask_Bx1xTxS, scale):
    scores = jnp.einsum("BHTK,BHSK->BHTS", q_BxHxTxK, k_BxHxSxK, preferred_element_type=jnp.float32)
    return jnp.where(mask_Bx1xTxS, scores * scale, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, mask, scale, block):
    return _attention_fwd(q, k, v, mask, scale, block)[0]


def _block_fwd(q_BxHxWxK, k_BxHxSxK, v_BxHxSxV, mask_Bx1xWxS, scale):
    """Softmax attention of W query rows over S keys -> (out [B, H, W, V], lse [B, H, W, 1])."""
    scores = _scores(q_BxHxWxK, k_BxHxSxK, mask_Bx1xWxS, scale)
    lse_BxHxWx1 = jax.nn.logsumexp(scores, axis=-1, keepdims=True)  # the diagonal is always visible: finite
    probs = jnp.exp(scores - lse_BxHxWx1).astype(v_BxHxSxV.dtype)
    out = jnp.einsum("BHWS,BHSV->BHWV", probs, v_BxHxSxV, preferred_element_type=jnp.float32)
    return out.astype(q_BxHxWxK.dtype), lse_BxHxWx1


def _attention_fwd(q, k, v, mask, scale, block):
    parts = [_block_fwd(q[:, :, s:e], k[:, :, :e], v[:, :, :e], mask[:, :, s:e, :e], scale)
             for s, e in _query_blocks(q.shape[2], block)]
    out = jnp.concatenate([o for o, _ in parts], axis=2)
    return out, (q, k, v, mask, out, jnp.concatenate([lse for _, lse in parts], axis=2))


def _attention_bwd(scale, block, res, dout_BxHxTxV):
    q, k, v, mask, out, lse = res
    dout = dout_BxHxTxV.astype(v.dtype)
    rowsum = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    dqs, dk, dv = [], None, None
    for s, e in reversed(_query_blocks(q.shape[2], block)):  # the last block sees every key: dk, dv start there
        q_b, k_b, v_b, dout_b = q[:, :, s:e], k[:, :, :e], v[:, :, :e], dout[:, :, s:e]
        probs = jnp.exp(_scores(q_b, k_b, mask[:, :, s:e, :e], scale) - lse[:, :, s:e])
        dv_b = jnp.einsum("BHTS,BHTV->BHSV", probs.astype(v.dtype), dout_b, preferred_element_type=jnp.float32)
        dprobs = jnp.einsum("BHTV,BHSV->BHTS", dout_b, v_b, preferred_element_type=jnp.float32)
        dscores = (probs * (dprobs - rowsum[:, :, s:e]) * scale).astype(q.dtype)
        dqs.append(jnp.einsum("BHTS,BHSK->BHTK", dscores, k_b, preferred_element_type=jnp.float32))
        dk_b = jnp.einsum("BHTS,BHTK->BHSK", dscores, q_b, preferred_element_type=jnp.float32)
        dk = dk_b if dk is None else dk.at[:, :, :e].add(dk_b)
        dv = dv_b if dv is None else dv.at[:, :, :e].add(dv_b)
    dq = jnp.concatenate(dqs[::-1], axis=2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)

"""The output head and next-token cross-entropy fused over chunks of positions (DeepSeek-V3 2.2).

Letters: B batch, T positions, N chunks, C positions per chunk, D model, V vocab.

loss = sum_bt w_bt (logsumexp(z_bt) - z_bt[target_bt]) with z = h W; d z = w (softmax(z) - onehot).

`head_nll` never forms the [B, T, V] logits: the positions are cut into chunks of C (the last one
padded with zero weights); each chunk's logits [B, C, V] give its loss and, in the same pass, its
gradients d h = d z W^T and d W += h^T d z, so the backward only scales them by the loss's
cotangent and the logits never return to memory. Chunks cut positions, not the batch, so a
batch-sharded `h` keeps its sharding and each device holds [B / devices, C, V] logits at a time.
`head_nll_reference` (same signature) forms the whole logits and lets autodiff do the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def head_nll_reference(h_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array, weights_BxT: jax.Array,
                       *, chunk: int = 0, compute_dtype=jnp.float32) -> jax.Array:
    """Weighted sum of -log softmax(h W)[target] in fp32 through the whole [B, T, V] logits."""
    del chunk
    z = jnp.einsum("BTD,DV->BTV", h_BxTxD.astype(compute_dtype), w_DxV.astype(compute_dtype),
                   preferred_element_type=jnp.float32)
    nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, targets_BxT[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights_BxT.astype(jnp.float32))


def head_nll(h_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array, weights_BxT: jax.Array,
             *, chunk: int, compute_dtype=jnp.float32) -> jax.Array:
    """Weighted sum of -log softmax(h W)[target] in fp32, C = `chunk` positions at a time.

    Args:
      h_BxTxD: hidden states after the final norm; w_DxV: the head; targets_BxT: int ids;
      weights_BxT: each token's weight (0 leaves it out: padding, non-targets).
      chunk: positions per chunk (T need not be a multiple); compute_dtype: the matmuls' inputs
        (fp32 accumulation), as the head's.
    Returns:
      [] fp32.
    """
    if chunk < 1:
        raise ValueError(f"head_nll: {chunk=} must be >= 1")
    return _head_nll(h_BxTxD, w_DxV, targets_BxT, weights_BxT, chunk, jnp.dtype(compute_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_nll(h, w, targets, weights, chunk, compute_dtype):
    nll = _scan(h, w, targets, weights, chunk, compute_dtype, grads=False)[0]
    return jnp.sum(nll * weights.astype(jnp.float32))


def _fwd(h, w, targets, weights, chunk, compute_dtype):
    nll, dh, dw = _scan(h, w, targets, weights, chunk, compute_dtype, grads=True)
    return jnp.sum(nll * weights.astype(jnp.float32)), (nll, dh, dw, targets, weights)


def _bwd(chunk, compute_dtype, res, g):
    nll, dh, dw, targets, weights = res
    return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None, (g * nll).astype(weights.dtype)


_head_nll.defvjp(_fwd, _bwd)


def _scan(h_BxTxD, w_DxV, targets_BxT, weights_BxT, chunk: int, dt, *, grads: bool):
    """Per-token nll [B, T] (unweighted), and with `grads` d h [B, T, D] and d W [D, V] of the weighted sum."""
    b, t, d = h_BxTxD.shape
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(x):  # [B, T, ...] -> [N, B, C, ...], padded positions at the end
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    w = w_DxV.astype(dt)
    xs = (split(h_BxTxD), split(targets_BxT), split(weights_BxT.astype(jnp.float32)))

    def step(dw_DxV, x):
        h, tgt, wt = x
        h = h.astype(dt)
        z = jnp.einsum("BCD,DV->BCV", h, w, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(z, axis=-1)
        nll = lse - jnp.take_along_axis(z, tgt[..., None], axis=-1)[..., 0]
        if not grads:
            return dw_DxV, (nll,)
        vocab_ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, 2)
        dz = (wt[..., None] * (jnp.exp(z - lse[..., None]) - (vocab_ids == tgt[..., None]))).astype(dt)
        dh = jnp.einsum("BCV,DV->BCD", dz, w, preferred_element_type=jnp.float32)
        dw_DxV = dw_DxV + jnp.einsum("BCD,BCV->DV", h, dz, preferred_element_type=jnp.float32)
        return dw_DxV, (nll, dh.astype(h_BxTxD.dtype))

    dw, out = jax.lax.scan(step, jnp.zeros(w_DxV.shape, jnp.float32), xs)

    def merge(x):  # [N, B, C, ...] -> [B, T, ...]
        return jnp.moveaxis(x, 0, 1).reshape(b, n * chunk, *x.shape[3:])[:, :t]

    if not grads:
        return (merge(out[0]),)
    return merge(out[0]), merge(out[1]), dw.astype(w_DxV.dtype)

"""The output head and next-token cross-entropy fused over chunks of positions (DeepSeek-V3 2.2).

Letters: B batch, T positions, N chunks, C positions per chunk, D model, V vocab.

loss = sum_bt w_bt (logsumexp(z_bt) - z_bt[target_bt]) with z = h W; d z = w (softmax(z) - onehot),
both from ops/cross_entropy.py (`nll_and_lse`, `nll_grad`), the formula of `token_nll`'s backward.

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

from dsv3_jax.ops.cross_entropy import nll_and_lse, nll_grad


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
    return _head_nll(chunk, jnp.dtype(compute_dtype).name)(h_BxTxD, w_DxV, targets_BxT, weights_BxT)


@functools.cache
def _head_nll(chunk: int, compute_dtype: str):
    """The custom-VJP function for one (chunk, dtype)."""

    @jax.custom_vjp
    def fn(h, w, targets, weights):
        nll, _, _ = _scan_chunks(h, w, targets, weights, chunk, compute_dtype, want_dh=False, want_dw=False,
                                 vocab_major=False)
        return jnp.sum(nll * weights.astype(jnp.float32))

    def fwd(h, w, targets, weights):
        """Forms only the gradients asked for: a head held constant (LoRA) skips h^T d z. On CPU the
        loop reads W as [V, D] for d h (`_scan_chunks`)."""
        scan = functools.partial(_scan_chunks, h.value, w.value, targets.value, weights.value, chunk, compute_dtype,
                                 want_dh=h.perturbed, want_dw=w.perturbed)
        nll, dh, dw = jax.lax.platform_dependent(cpu=functools.partial(scan, vocab_major=True),
                                                 default=functools.partial(scan, vocab_major=False))
        loss = jnp.sum(nll * weights.value.astype(jnp.float32))
        return loss, (nll.astype(weights.value.dtype) if weights.perturbed else None, dh, dw)

    def bwd(res, g):
        nll, dh, dw = res  # d loss / d weights = nll
        return _scaled(g, dh), _scaled(g, dw), None, _scaled(g, nll)

    fn.defvjp(fwd, bwd, symbolic_zeros=True)
    return fn


def _scaled(g, x):
    return None if x is None else (g * x).astype(x.dtype)


def _scan_chunks(h_BxTxD, w_DxV, targets_BxT, weights_BxT, chunk: int, dt, *, want_dh: bool, want_dw: bool,
                 vocab_major: bool):
    """Per-token nll [B, T] (unweighted) and, as asked, d h [B, T, D] and d W [D, V] of the weighted
    sum (None when not asked). d h = d z W^T reads W as [D, V] or, `vocab_major`, as [V, D]: one
    transposed copy of W a step, so that XLA:CPU runs a plain [C, V] x [V, D] matmul, faster there
    than reading W transposed in the dot (docs/benchmarks.md, Kernel choices). d W stays [D, V]:
    summing d W^T in [V, D] was slower."""
    b, t, _ = h_BxTxD.shape
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(x):  # [B, T, ...] -> [N, B, C, ...], padded positions at the end
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    def merge(x):  # [N, B, C, ...] -> [B, T, ...]
        return jnp.moveaxis(x, 0, 1).reshape(b, n * chunk, *x.shape[3:])[:, :t]

    w = w_DxV.astype(dt)
    w_VxD = jnp.transpose(w) if vocab_major else None  # loop-invariant: the loop body cannot fold it back
    xs = (split(h_BxTxD), split(targets_BxT), split(weights_BxT.astype(jnp.float32)))

    def step(dw, x):
        h, tgt, wt = x
        h = h.astype(dt)
        z = jnp.einsum("BCD,DV->BCV", h, w, preferred_element_type=jnp.float32)
        nll, lse = nll_and_lse(z, tgt)
        if not (want_dh or want_dw):
            return dw, (nll, None)
        dz = nll_grad(z, tgt, lse, wt).astype(dt)  # the token's weight is its loss's cotangent
        dh = None
        if want_dh:
            dh = (jnp.einsum("BCV,VD->BCD", dz, w_VxD, preferred_element_type=jnp.float32) if vocab_major else
                  jnp.einsum("BCV,DV->BCD", dz, w, preferred_element_type=jnp.float32)).astype(h_BxTxD.dtype)
        if want_dw:
            dw = dw + jnp.einsum("BCD,BCV->DV", h, dz, preferred_element_type=jnp.float32)
        return dw, (nll, dh)

    dw, (nll, dh) = jax.lax.scan(step, jnp.zeros(w_DxV.shape, jnp.float32) if want_dw else None, xs)
    if dw is not None:
        dw = dw.astype(w_DxV.dtype)
    return merge(nll), None if dh is None else merge(dh), dw

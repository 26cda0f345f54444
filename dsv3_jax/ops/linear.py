"""Projections: x contracted with the leading axes of a weight, in the compute dtype or in FP8.

FP8 follows the DeepSeek-V3 recipe: activations quantised per 1x128 tile, weights per 128x128
block (e4m3, scale = amax / 448), each 128-wide K block's partial product accumulated and scaled in
fp32 (`pallas_kernels.fp8_matmul`). The backward pass is straight-through in the compute dtype:
master weights and gradients never see the quantisation error's discontinuities.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _flatten(x, w, contract: int):
    k = 1
    for d in w.shape[:contract]:
        k *= d
    return x.reshape(-1, k), w.reshape(k, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul(x_MxK, w_KxN, out_dtype):
    import pallas_kernels  # kernels carry no model knowledge; imported only on the FP8 path

    x_q, x_scale = pallas_kernels.quantize_1x128(x_MxK.astype(jnp.float32))
    w_q, w_scale = pallas_kernels.quantize_128x128(w_KxN.T.astype(jnp.float32))
    return pallas_kernels.fp8_matmul(x_q, x_scale, w_q, w_scale, out_dtype=out_dtype)


def _fp8_fwd(x, w, out_dtype):
    return _fp8_matmul(x, w, out_dtype), (x, w)


def _fp8_bwd(out_dtype, res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = jnp.einsum("MN,KN->MK", g, w.astype(x.dtype), preferred_element_type=jnp.float32)
    dw = jnp.einsum("MK,MN->KN", x, g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)


def project(x: jax.Array, w: jax.Array, *, contract: int, compute_dtype, fp8: bool = False) -> jax.Array:
    """x [..., *w.shape[:contract]] . w -> [..., *w.shape[contract:]] in `compute_dtype`.

    The plain path is one einsum with fp32 accumulation; `fp8` routes through the FP8 kernel.
    """
    batch, out = x.shape[: x.ndim - contract], w.shape[contract:]
    x, w = x.astype(compute_dtype), w.astype(compute_dtype)
    if fp8:
        x2, w2 = _flatten(x, w, contract)
        return _fp8_matmul(x2, w2, jnp.dtype(compute_dtype)).reshape(*batch, *out)
    y = jax.lax.dot_general(x, w, (((tuple(range(x.ndim - contract, x.ndim))), tuple(range(contract))), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(compute_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_grouped_matmul(x_MxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array, out_dtype) -> jax.Array:
    """Rows sorted by group times their group's weight, through the FP8 grouped kernel.

    Backward is straight-through via `ragged_dot` in x's dtype.
    """
    import pallas_kernels

    x_q, x_scale = pallas_kernels.quantize_1x128(x_MxK.astype(jnp.float32))
    w_q, w_scale = jax.vmap(pallas_kernels.quantize_128x128)(jnp.swapaxes(w_GxKxN, 1, 2).astype(jnp.float32))
    return pallas_kernels.fp8_grouped_matmul(x_q, x_scale, w_q, w_scale, group_sizes_G, out_dtype=out_dtype)


def _grouped_fwd(x, w, sizes, out_dtype):
    return fp8_grouped_matmul(x, w, sizes, out_dtype), (x, w, sizes)


def _grouped_bwd(out_dtype, res, g):
    x, w, sizes = res
    _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32), x, w)
    dx, dw = vjp(g.astype(jnp.float32))
    return dx.astype(x.dtype), dw.astype(w.dtype), None


fp8_grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)

"""FP8 (e4m3) block quantisation, DeepSeek recipe: 1x128 tiles for activations, 128x128 for weights.

`scale = max(amax_of_tile, min_amax) / 448`, `q = cast_e4m3(x / scale)`; with `pow2_scale` the scale
is rounded *up* to a power of two ("ue8m0"), so `|x / scale| <= 448` still holds. `min_amax`
defaults to DeepGEMM's 1e-4, right for weights and activations; gradients, whose size follows the
loss normalisation (~1/tokens per step), need a floor that only guards all-zero tiles. Partial edge
tiles (K or N not multiples of 128) are quantised over their valid elements only.

Shapes: M rows (tokens), N output features, K contraction; KB = ceil(K/128), NB = ceil(N/128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._backend import pad_axis

TILE = 128
E4M3_MAX = 448.0
MIN_AMAX = 1e-4


def _scale_from_amax(amax: jax.Array, pow2_scale: bool, min_amax: float) -> jax.Array:
    scale = jnp.maximum(amax, min_amax) / E4M3_MAX
    if pow2_scale:
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    return scale.astype(jnp.float32)


def _cast_e4m3(x: jax.Array) -> jax.Array:
    # Division can land an ulp above 448; e4m3fn has no inf, so clip before the cast.
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def _quantize_tiles(x_NxK: jax.Array, row_tile: int, pow2_scale: bool, min_amax: float):
    """(q [N,K] e4m3, scale [ceil(N/row_tile), KB] f32): one scale per row_tile x 128 tile."""
    n, k = x_NxK.shape
    nb, kb = -(-n // row_tile), -(-k // TILE)
    x = pad_axis(pad_axis(x_NxK.astype(jnp.float32), 0, nb * row_tile), 1, kb * TILE)
    x = x.reshape(nb, row_tile, kb, TILE)
    scale_NBxKB = _scale_from_amax(jnp.max(jnp.abs(x), axis=(1, 3)), pow2_scale, min_amax)
    q = _cast_e4m3(x / scale_NBxKB[:, None, :, None])
    return q.reshape(nb * row_tile, kb * TILE)[:n, :k], scale_NBxKB


@functools.partial(jax.jit, static_argnames=("pow2_scale", "min_amax"))
def quantize_1x128(x_MxK: jax.Array, *, pow2_scale: bool = False, min_amax: float = MIN_AMAX):
    """Per-(row, 128-column) quantisation. Returns (x_q [M,K] e4m3, scale [M,KB] f32)."""
    if x_MxK.ndim != 2:
        raise ValueError(f"quantize_1x128 expects [M, K], got {x_MxK.shape=}")
    return _quantize_tiles(x_MxK, 1, pow2_scale, min_amax)


@functools.partial(jax.jit, static_argnames=("pow2_scale", "min_amax"))
def quantize_128x128(w_NxK: jax.Array, *, pow2_scale: bool = False, min_amax: float = MIN_AMAX):
    """Per-(128x128 block) quantisation. Returns (w_q [N,K] e4m3, scale [NB,KB] f32).

    The checkpoint converter keeps a numpy twin (`dsv3_jax/checkpoint/fp8.py:quantize`) because the
    two differ by design: XLA compiles `amax / 448` into `amax * fp32(1/448)`, an ulp off numpy's
    exact division in about half the scales, and the converter's files keep the exact division."""
    if w_NxK.ndim != 2:
        raise ValueError(f"quantize_128x128 expects [N, K], got {w_NxK.shape=}")
    return _quantize_tiles(w_NxK, TILE, pow2_scale, min_amax)


def expand_scale(scale: jax.Array, rows: int, cols: int, row_tile: int) -> jax.Array:
    """Broadcasts a block scale [ceil(rows/row_tile), ceil(cols/128)] to [rows, cols]."""
    s = jnp.repeat(jnp.repeat(scale, row_tile, axis=0), TILE, axis=1)
    return s[:rows, :cols]


@jax.jit
def dequantize_1x128(x_q: jax.Array, scale_MxKB: jax.Array) -> jax.Array:
    """Inverse of `quantize_1x128`: fp32 [M, K]."""
    m, k = x_q.shape
    return x_q.astype(jnp.float32) * expand_scale(scale_MxKB, m, k, 1)


@jax.jit
def dequantize_128x128(w_q: jax.Array, scale_NBxKB: jax.Array) -> jax.Array:
    """Inverse of `quantize_128x128`: fp32 [N, K] (`fp32(q) * s[i//128, j//128]`)."""
    n, k = w_q.shape
    return w_q.astype(jnp.float32) * expand_scale(scale_NBxKB, n, k, TILE)


def check_scale_shapes(name: str, q: jax.Array, scale: jax.Array, row_tile: int) -> None:
    """Raises if `scale` is not [ceil(rows/row_tile), ceil(K/128)] for `q` [rows, K]."""
    if q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{name} must be float8_e4m3fn, got {q.dtype=}")
    want = (-(-q.shape[-2] // row_tile), -(-q.shape[-1] // TILE))
    if tuple(scale.shape[-2:]) != want:
        raise ValueError(f"{name} scale has shape {scale.shape}; expected trailing dims {want} "
                         f"for {name} of shape {q.shape} (tiles of {row_tile}x{TILE})")

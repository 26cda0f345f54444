"""FP8 weight-gradient GEMM of grouped (MoE) experts: the contraction runs over each group's tokens.

out[g] = sum_{b : tile_group[b] == g} (f32(lhs_q[:, b]) . f32(rhs_q[:, b])^T) * lhs_scale[:, b] * rhs_scale[:, b]^T

with `b` a 128-token block. Both operands are activations transposed to [features, tokens] and
quantised in 1x128 tiles along the tokens (128x1 tiles of the [tokens, features] layout, as in
the DeepSeek-V3 paper's Wgrad); each block's partial product is promoted to fp32 and scaled there,
like `fp8_matmul`. Tokens are in the group-aligned layout of `group_aligned_rows`: every
128-token block belongs to one group and `tile_group` is non-decreasing. Groups without tokens
give 0. Letters: K, N the two feature axes of the weight, T padded tokens, TB = T/128 blocks,
G groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _backend
from pallas_kernels._backend import pad_axis, round_up
from pallas_kernels.fp8_grouped_matmul import tile_layout
from pallas_kernels.fp8_matmul import BlockSizes, scaled_block_dot
from pallas_kernels.quantize import TILE, check_scale_shapes


def group_aligned_rows(group_sizes_G: jax.Array, m: int):
    """(dest_M, tile_group_TB): row m of the sorted rows goes to token dest[m] of a layout where
    each group starts on a 128 boundary; rows past sum(group_sizes) get an out-of-range dest."""
    tiles = tile_layout(group_sizes_G, m, TILE)
    return tiles.dest_M, tiles.tile_group


def _tpu_kernel(tg_ref, lhs_ref, ls_ref, rhs_ref, rs_ref, o_ref, acc_ref, *, dot_dtype):
    b, nb = pl.program_id(2), pl.num_programs(2)
    g = tg_ref[b]
    first = jnp.logical_or(b == 0, tg_ref[jnp.maximum(b - 1, 0)] != g)
    last = jnp.logical_or(b == nb - 1, tg_ref[jnp.minimum(b + 1, nb - 1)] != g)

    def update(acc):
        return acc + scaled_block_dot(lhs_ref[...], rhs_ref[...], ls_ref[...], rs_ref[...], dot_dtype)

    _backend.accumulate(acc_ref, o_ref, update, first=first, last=last)


def _triton_kernel(start_ref, count_ref, lhs_ref, ls_ref, rhs_ref, rs_ref, o_ref, *, dot_dtype):
    g = pl.program_id(2)
    start = start_ref[g]

    def body(t, acc):
        b = start + t
        cols = pl.ds(pl.multiple_of(b * TILE, TILE), TILE)
        return acc + scaled_block_dot(lhs_ref[:, cols], rhs_ref[:, cols], ls_ref[b], rs_ref[b], dot_dtype)

    acc0 = jnp.zeros((lhs_ref.shape[0], rhs_ref.shape[0]), jnp.float32)
    o_ref[...] = lax.fori_loop(0, count_ref[g], body, acc0).astype(o_ref.dtype)


def _check(lhs_q, lhs_scale, rhs_q, rhs_scale, tile_group, group_sizes):
    if lhs_q.ndim != 2 or rhs_q.ndim != 2 or lhs_q.shape[1] != rhs_q.shape[1]:
        raise ValueError(f"need lhs_q [K,T], rhs_q [N,T] with equal T; got {lhs_q.shape=}, {rhs_q.shape=}")
    if lhs_q.shape[1] % TILE:
        raise ValueError(f"tokens T={lhs_q.shape[1]} must be a multiple of {TILE} (group-aligned layout)")
    if tile_group.shape != (lhs_q.shape[1] // TILE,):
        raise ValueError(f"{tile_group.shape=} must be ({lhs_q.shape[1] // TILE},), one group per block")
    if group_sizes.ndim != 1:
        raise ValueError(f"{group_sizes.shape=} must be [G]")
    check_scale_shapes("lhs_q", lhs_q, lhs_scale, 1)
    check_scale_shapes("rhs_q", rhs_q, rhs_scale, 1)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "backend", "interpret"))
def fp8_grouped_wgrad(lhs_q, lhs_scale, rhs_q, rhs_scale, tile_group, group_sizes, *,
                      out_dtype=jnp.float32, block_sizes: BlockSizes | None = None, backend=None,
                      interpret=None):
    """lhs_q [K,T] e4m3, lhs_scale [K,TB], rhs_q [N,T] e4m3, rhs_scale [N,TB], tile_group [TB],
    group_sizes [G] (only which are empty) -> [G,K,N]. `block_m`/`block_n` tile K and N."""
    be = _backend.resolve(backend, interpret)
    bs = block_sizes or BlockSizes()
    bs.validate(be)
    _check(lhs_q, lhs_scale, rhs_q, rhs_scale, tile_group, group_sizes)
    (k, t), n, g = lhs_q.shape, rhs_q.shape[0], group_sizes.shape[0]
    bm, bn, nb = bs.block_m, bs.block_n, t // TILE
    kp, np_ = round_up(k, bm), round_up(n, bn)
    lhs, rhs = pad_axis(lhs_q, 0, kp), pad_axis(rhs_q, 0, np_)
    ls = pad_axis(lhs_scale.astype(jnp.float32), 0, kp).T[:, :, None]  # [TB, Kp, 1]
    rs = pad_axis(rhs_scale.astype(jnp.float32), 0, np_).T[:, None, :]  # [TB, 1, Np]
    tile_group = tile_group.astype(jnp.int32)
    dot_dtype = bs.dot_dtype(be)
    out_shape = jax.ShapeDtypeStruct((g, kp, np_), out_dtype)
    if be.style == "tpu":
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(kp // bm, np_ // bn, nb),
            in_specs=[pl.BlockSpec((bm, TILE), lambda i, j, b, tg: (i, b)),
                      pl.BlockSpec((None, bm, 1), lambda i, j, b, tg: (b, i, 0)),
                      pl.BlockSpec((bn, TILE), lambda i, j, b, tg: (j, b)),
                      pl.BlockSpec((None, 1, bn), lambda i, j, b, tg: (b, 0, j))],
            out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, b, tg: (tg[b], i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)])
        kernel = functools.partial(_tpu_kernel, dot_dtype=dot_dtype)
        operands = (tile_group, lhs, ls, rhs, rs)
    else:
        count = jnp.zeros((g,), jnp.int32).at[tile_group].add(1)
        start = jnp.cumsum(count) - count
        grid_spec = pl.GridSpec(
            grid=(kp // bm, np_ // bn, g),
            in_specs=[pl.BlockSpec((g,), lambda i, j, gi: (0,)),
                      pl.BlockSpec((g,), lambda i, j, gi: (0,)),
                      pl.BlockSpec((bm, t), lambda i, j, gi: (i, 0)),
                      pl.BlockSpec((nb, bm, 1), lambda i, j, gi: (0, i, 0)),
                      pl.BlockSpec((bn, t), lambda i, j, gi: (j, 0)),
                      pl.BlockSpec((nb, 1, bn), lambda i, j, gi: (0, 0, j))],
            out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, gi: (gi, i, j)))
        kernel = functools.partial(_triton_kernel, dot_dtype=dot_dtype)
        operands = (start, count, lhs, ls, rhs, rs)
    out = _backend.pallas_call(be, kernel, name="fp8_grouped_wgrad", out_shape=out_shape,
                               grid_spec=grid_spec)(*operands)
    # A group without tokens owns no block, so the TPU grid never writes its output.
    return jnp.where((group_sizes > 0)[:, None, None], out[:, :k, :n], 0).astype(out_dtype)


def fp8_grouped_wgrad_reference(lhs_q, lhs_scale, rhs_q, rhs_scale, tile_group, group_sizes, *,
                                out_dtype=jnp.float32, **_):
    """Plain jnp, same promotion: every block's scaled fp32 partial product, summed per group."""
    (k, t), n = lhs_q.shape, rhs_q.shape[0]
    lhs_KxTBx128 = lhs_q.astype(jnp.float32).reshape(k, t // TILE, TILE)
    rhs_NxTBx128 = rhs_q.astype(jnp.float32).reshape(n, t // TILE, TILE)
    part_TBxKxN = jnp.einsum("kbt,nbt->bkn", lhs_KxTBx128, rhs_NxTBx128, precision=lax.Precision.HIGHEST)
    part_TBxKxN = part_TBxKxN * lhs_scale.T[:, :, None] * rhs_scale.T[:, None, :]
    out = jax.ops.segment_sum(part_TBxKxN, tile_group, num_segments=group_sizes.shape[0])
    return jnp.where((group_sizes > 0)[:, None, None], out, 0).astype(out_dtype)

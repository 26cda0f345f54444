"""FP8 block-scaled grouped matmul for MoE experts (contiguous layout), same promotion as
`fp8_matmul`: rows [start_g, start_g + group_sizes[g]) of x use expert g's weights.

Tile-padded scheme: each group's rows are scattered to a start that is a multiple of
`block_m`, so every M tile belongs to exactly one group; a tile -> group map (scalar prefetch on
TPU, an ordinary input on Triton) picks the expert's weight blocks; unused tiles are skipped and
the result rows are gathered back. Rows beyond sum(group_sizes) give 0. The padded tile count is
static: ceil(M / block_m) + G. Letters: M rows, G groups (experts), N out, K in.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _backend
from pallas_kernels._backend import round_up
from pallas_kernels.fp8_matmul import (BlockSizes, fp8_matmul_reference, pad_w_operands,
                                       pad_x_operands, tpu_kernel, triton_block_loop)
from pallas_kernels.quantize import TILE, check_scale_shapes


def tile_layout(group_sizes, m: int, block_m: int):
    """Row destinations in the tile-padded layout and per-tile (group, valid) metadata."""
    g = group_sizes.shape[0]
    sizes = jnp.minimum(jnp.maximum(group_sizes.astype(jnp.int32), 0), m)
    ends = jnp.minimum(jnp.cumsum(sizes), m)  # rows past M (over-full groups) are dropped
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    padded = round_up(ends - starts, block_m)
    pad_ends = jnp.cumsum(padded)
    pad_starts = pad_ends - padded
    num_tiles = -(-m // block_m) + g
    rows = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.searchsorted(ends, rows, side="right")
    in_group = rows < ends[-1]
    safe_g = jnp.minimum(row_group, g - 1)
    dest = jnp.where(in_group, pad_starts[safe_g] + rows - starts[safe_g], num_tiles * block_m)
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    tile_group = jnp.searchsorted(pad_ends, tile_start, side="right").astype(jnp.int32)
    tile_valid = (tile_start < pad_ends[-1]).astype(jnp.int32)
    last_group = jnp.max(jnp.where(tile_valid == 1, tile_group, 0))
    tile_group = jnp.where(tile_valid == 1, tile_group, last_group)  # unused tiles: no new DMA
    return dest, tile_group, tile_valid, num_tiles


def _tpu_grouped_kernel(tg_ref, valid_ref, *refs, **kw):
    del tg_ref  # consumed by the index maps
    o_ref = refs[4]
    valid, k, num_k = valid_ref[pl.program_id(0)], pl.program_id(2), pl.num_programs(2)

    @pl.when(valid == 1)
    def _():
        tpu_kernel(*refs, k=k, num_k=num_k, **kw)

    @pl.when(valid == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)


def _triton_grouped_kernel(tg_ref, valid_ref, x_ref, xs_ref, w_ref, ws_ref, o_ref, *, num_k,
                           n_padded, block_n, **kw):
    i, j = pl.program_id(0), pl.program_id(1)
    w_row0 = tg_ref[i] * n_padded + j * block_n
    acc = triton_block_loop(x_ref, xs_ref, w_ref, ws_ref, w_row0, num_k=num_k * valid_ref[i],
                            block_n=block_n, **kw)
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "backend", "interpret"))
def fp8_grouped_matmul(x_q, x_scale, w_q, w_scale, group_sizes, *, out_dtype=jnp.bfloat16,
                       block_sizes: BlockSizes | None = None, backend=None, interpret=None):
    """x_q [M,K] e4m3, x_scale [M,KB], w_q [G,N,K] e4m3, w_scale [G,NB,KB], group_sizes [G] -> [M,N]."""
    be = _backend.resolve(backend, interpret)
    bs = block_sizes or BlockSizes()
    bs.validate(be)
    if x_q.ndim != 2 or w_q.ndim != 3 or x_q.shape[1] != w_q.shape[2]:
        raise ValueError(f"need x_q [M,K], w_q [G,N,K] with equal K; got {x_q.shape=}, {w_q.shape=}")
    if group_sizes.shape != (w_q.shape[0],):
        raise ValueError(f"{group_sizes.shape=} must be ({w_q.shape[0]},), one size per group")
    check_scale_shapes("x_q", x_q, x_scale, 1)
    check_scale_shapes("w_q", w_q, w_scale, TILE)
    (m, k), (g, n, _) = x_q.shape, w_q.shape
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    np_, kp = round_up(n, bn), round_up(k, bk)
    subs, kbp = bk // TILE, kp // TILE
    dest, tile_group, tile_valid, num_tiles = tile_layout(group_sizes, m, bm)
    mp = num_tiles * bm
    x = jnp.zeros((mp, k), x_q.dtype).at[dest].set(x_q, mode="drop")
    xs = jnp.zeros((mp, x_scale.shape[1]), jnp.float32).at[dest].set(x_scale, mode="drop")
    x, xs = pad_x_operands(x, xs, mp, kp)
    w, ws = pad_w_operands(w_q, w_scale, np_, kp)  # [G,Np,Kp], [G,KBp,1,Np]
    kw = dict(subs=subs, dot_dtype=bs.dot_dtype(be))
    out_shape = jax.ShapeDtypeStruct((mp, np_), out_dtype)
    if be.style == "tpu":
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(num_tiles, np_ // bn, kp // bk),
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk, tg, v: (i, kk * v[i])),
                      pl.BlockSpec((subs, bm, 1), lambda i, j, kk, tg, v: (kk * v[i], i, 0)),
                      pl.BlockSpec((None, bn, bk), lambda i, j, kk, tg, v: (tg[i], j, kk * v[i])),
                      pl.BlockSpec((None, subs, 1, bn), lambda i, j, kk, tg, v: (tg[i], kk * v[i], 0, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk, tg, v: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)])
        kernel = functools.partial(_tpu_grouped_kernel, **kw)
    else:
        w = w.reshape(g * np_, kp)
        ws = jnp.moveaxis(ws, 0, 2).reshape(kbp, 1, g * np_)
        grid_spec = pl.GridSpec(
            grid=(num_tiles, np_ // bn),
            in_specs=[pl.BlockSpec((num_tiles,), lambda i, j: (0,)),
                      pl.BlockSpec((num_tiles,), lambda i, j: (0,)),
                      pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                      pl.BlockSpec((kbp, bm, 1), lambda i, j: (0, i, 0)),
                      pl.BlockSpec((g * np_, kp), lambda i, j: (0, 0)),
                      pl.BlockSpec((kbp, 1, g * np_), lambda i, j: (0, 0, 0))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)))
        kernel = functools.partial(_triton_grouped_kernel, num_k=kp // bk, n_padded=np_,
                                   block_n=bn, **kw)
    out = _backend.pallas_call(be, kernel, name="fp8_grouped_matmul", out_shape=out_shape,
                               grid_spec=grid_spec)(tile_group, tile_valid, x, xs, w, ws)
    return jnp.take(out[:, :n], dest, axis=0, mode="fill", fill_value=0)


def fp8_grouped_matmul_reference(x_q, x_scale, w_q, w_scale, group_sizes, *,
                                 out_dtype=jnp.bfloat16, **_):
    """Plain jnp: every group's dense `fp8_matmul_reference`, kept on that group's rows."""
    def dense(gi):
        return fp8_matmul_reference(x_q, x_scale, w_q[gi], w_scale[gi], out_dtype=jnp.float32)

    return grouped_rows_reference(dense, group_sizes, x_q.shape[0], w_q.shape[1], w_q.shape[0]).astype(out_dtype)


def grouped_rows_reference(dense_fn, group_sizes, m: int, n: int, groups: int):
    """[M, N] fp32: dense_fn(g) ([M, N] fp32, every row through group g's weights) kept on group g's
    rows, rows [start_g, start_g + group_sizes[g]) of the contiguous layout; other rows give 0."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row_group = jnp.searchsorted(ends, jnp.arange(m), side="right")

    def one_group(acc, gi):
        return acc + jnp.where((row_group == gi)[:, None], dense_fn(gi), 0.0), None

    out, _ = jax.lax.scan(one_group, jnp.zeros((m, n), jnp.float32), jnp.arange(groups))
    return out

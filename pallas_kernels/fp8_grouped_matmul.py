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
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels._backend import round_up
from pallas_kernels.fp8_matmul import BlockSizes, fp8_matmul_reference, pad_w_operands, pad_x_operands, tiled_call
from pallas_kernels.quantize import TILE, check_scale_shapes


class TileLayout(NamedTuple):
    """Rows of M padded per group to whole tiles of `block_m` rows: row m goes to row dest_M[m] of the
    [num_tiles * block_m] layout (num_tiles * block_m past sum(group_sizes)); tile i holds group
    tile_group[i]'s rows, or none (tile_valid[i] == 0, its group then the last used one: no new DMA)."""

    dest_M: jax.Array
    tile_group: jax.Array
    tile_valid: jax.Array
    num_tiles: int
    block_m: int

    def scatter(self, a_MxA):
        """[M, A] -> [num_tiles * block_m, A] in the layout, zero rows elsewhere."""
        rows = jnp.zeros((self.num_tiles * self.block_m, a_MxA.shape[1]), a_MxA.dtype)
        return rows.at[self.dest_M].set(a_MxA, mode="drop")

    def gather(self, out_PxA):
        """The inverse: each row's result back in the row order of M, 0 past sum(group_sizes)."""
        return jnp.take(out_PxA, self.dest_M, axis=0, mode="fill", fill_value=0)


def tile_layout(group_sizes, m: int, block_m: int) -> TileLayout:
    """The tile-padded layout of M rows in groups of `group_sizes` (over-full groups cut at M)."""
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
    return TileLayout(dest, tile_group, tile_valid, num_tiles, block_m)


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
    (m, k), n = x_q.shape, w_q.shape[1]
    np_, kp = round_up(n, bs.block_n), round_up(k, bs.block_k)
    tiles = tile_layout(group_sizes, m, bs.block_m)
    mp = tiles.num_tiles * bs.block_m
    x, xs = pad_x_operands(tiles.scatter(x_q), tiles.scatter(x_scale.astype(jnp.float32)), mp, kp)
    w, ws = pad_w_operands(w_q, w_scale, np_, kp)  # [G,Np,Kp], [G,KBp,1,Np]
    out = tiled_call(be, bs, x, xs, w, ws, tiles.tile_group, tiles.tile_valid, out_dtype, "fp8_grouped_matmul")
    return tiles.gather(out[:, :n])


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

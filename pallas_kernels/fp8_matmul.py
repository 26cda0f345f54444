"""FP8 block-scaled matmul with per-128-K-block fp32 promotion (DeepSeek / DeepGEMM recipe).

out[m, n] = sum_kb (sum_{k in kb} f32(x_q[m, k]) * f32(w_q[n, k])) * x_scale[m, kb] * w_scale[n // 128, kb]

Each 128-wide K block's partial product is accumulated in fp32 and scaled there, so the
scales never enter the low-precision dot. The right operand's scale is per 128x128 block
([NB, KB]: a weight, Fprop and Dgrad) or per row ([N, KB]: 1x128 tiles of an activation, the
Wgrad GEMM, whose K is the token axis); `rhs_row_scale` tells them apart by shape.
Letters: M rows, N output features, K contraction, KB = K/128 blocks; `bm, bn, bk` block sizes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _backend
from pallas_kernels._backend import dot_f32, pad_axis, round_up
from pallas_kernels.quantize import TILE, check_scale_shapes


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables. `block_k` is a multiple of 128 (several promotion blocks per step).

    `fp8_dot`: feed e4m3 straight to the MXU/tensor core (Hopper / TPU v7); None picks it
    for Triton only. Otherwise the kernel widens e4m3 to bf16 first, which is exact.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    fp8_dot: bool | None = None

    def validate(self, be: _backend.Backend) -> None:
        if self.block_k % TILE:
            raise ValueError(f"block_k={self.block_k} must be a multiple of {TILE}")
        _backend.check_blocks(be, rows=("block_m",), lanes=("block_n",), block_m=self.block_m, block_n=self.block_n,
                              block_k=self.block_k)

    def dot_dtype(self, be: _backend.Backend):
        native = self.fp8_dot if self.fp8_dot is not None else be.style == "triton"
        return None if native else jnp.bfloat16


def scaled_block_dot(x_blk, w_blk, xs_col, ws_row, dot_dtype):
    """One promotion block: ([bm,128] . [bn,128]^T) in fp32, times xs [bm,1] and ws [1,bn]."""
    if dot_dtype is not None:
        x_blk, w_blk = x_blk.astype(dot_dtype), w_blk.astype(dot_dtype)
    return dot_f32(x_blk, w_blk, "NT") * xs_col.astype(jnp.float32) * ws_row.astype(jnp.float32)


def _tpu_kernel(tg_ref, valid_ref, x_ref, xs_ref, w_ref, ws_ref, o_ref, acc_ref, *, subs, dot_dtype):
    """Grid (row tiles, N blocks, K blocks), K last: accumulate in VMEM scratch, write on the last K
    step. A row tile of no group (valid 0) adds nothing and writes zeros."""
    del tg_ref  # consumed by the index maps
    k, num_k = pl.program_id(2), pl.num_programs(2)

    def update(acc):
        for s in range(subs):
            sl = slice(s * TILE, (s + 1) * TILE)
            acc += scaled_block_dot(x_ref[:, sl], w_ref[:, sl], xs_ref[s], ws_ref[s], dot_dtype)
        return acc

    _backend.accumulate(acc_ref, o_ref, update, first=k == 0, last=k == num_k - 1,
                        active=valid_ref[pl.program_id(0)] == 1)


def _triton_kernel(tg_ref, valid_ref, x_ref, xs_ref, w_ref, ws_ref, o_ref, *, num_k, n_padded, subs,
                   dot_dtype, block_n):
    """In-kernel K loop over full-K refs (Triton: no scratch); the tile's weight rows start at its
    group's block of `w_ref`, and a row tile of no group runs no step."""
    i, j = pl.program_id(0), pl.program_id(1)
    w_row0 = tg_ref[i] * n_padded + j * block_n

    def body(k, acc):
        for s in range(subs):
            kb = k * subs + s
            cols = pl.ds(pl.multiple_of(kb * TILE, TILE), TILE)
            w_blk = w_ref[pl.ds(w_row0, block_n), cols]
            ws_row = ws_ref[kb, :, pl.ds(w_row0, block_n)]
            acc += scaled_block_dot(x_ref[:, cols], w_blk, xs_ref[kb], ws_row, dot_dtype)
        return acc

    acc0 = jnp.zeros((x_ref.shape[0], block_n), jnp.float32)
    o_ref[...] = lax.fori_loop(0, num_k * valid_ref[i], body, acc0).astype(o_ref.dtype)


def pad_x_operands(x_q, x_scale, rows: int, kp: int):
    """x_q -> [rows, Kp] (zero pad); x_scale [M,KB] -> [KBp, rows, 1] (column per K block)."""
    x = pad_axis(pad_axis(x_q, 0, rows), 1, kp)
    xs = pad_axis(pad_axis(x_scale.astype(jnp.float32), 0, rows), 1, kp // TILE)
    return x, xs.T[:, :, None]


def rhs_row_scale(w_scale, n: int):
    """Block scale [..., NB, KB] or per-row scale [..., N, KB] -> per-row fp32 [..., N, KB].

    The two shapes coincide only for N == 1, where they also mean the same thing."""
    w_scale = w_scale.astype(jnp.float32)
    if w_scale.shape[-2] == n:
        return w_scale
    return jnp.repeat(w_scale, TILE, axis=-2)[..., :n, :]


def pad_w_operands(w_q, w_scale, np_: int, kp: int):
    """w_q [...,N,K] -> [...,Np,Kp]; w_scale [...,NB|N,KB] -> per-row [...,KBp,1,Np]."""
    n = w_q.shape[-2]
    w = pad_axis(pad_axis(w_q, -2, np_), -1, kp)
    ws = rhs_row_scale(w_scale, n)
    ws = pad_axis(pad_axis(ws, -2, np_), -1, kp // TILE)
    return w, jnp.swapaxes(ws, -1, -2)[..., :, None, :]


def row_tile_call(be: _backend.Backend, kernel, in_specs, *, name: str, num_tiles: int, block_m: int, block_n: int,
                  n_padded: int, k_steps: int, out_dtype):
    """`pallas_call` of a kernel over row tiles of `block_m` rows, each through its group's weights, out
    [num_tiles * block_m, n_padded] in (block_m, block_n) blocks. The operands are the tile -> group map
    and tile validity [num_tiles], then those of `in_specs`: TPU prefetches the first two as scalars
    for the index maps and runs `k_steps` K steps into a VMEM accumulator on a third grid axis; Triton
    takes them as ordinary inputs and loops over K in the kernel."""
    grid = (num_tiles, n_padded // block_n)
    out_specs = pl.BlockSpec((block_m, block_n), lambda i, j, *_: (i, j))
    if be.style == "tpu":
        grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=grid + (k_steps,), in_specs=in_specs,
                                                 out_specs=out_specs,
                                                 scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)])
    else:
        per_tile = pl.BlockSpec((num_tiles,), lambda i, j: (0,))
        grid_spec = pl.GridSpec(grid=grid, in_specs=[per_tile, per_tile] + in_specs, out_specs=out_specs)
    out_shape = jax.ShapeDtypeStruct((num_tiles * block_m, n_padded), out_dtype)
    return _backend.pallas_call(be, kernel, name=name, out_shape=out_shape, grid_spec=grid_spec)


def tiled_call(be: _backend.Backend, bs: BlockSizes, x, xs, w, ws, tile_group, tile_valid, out_dtype, name: str):
    """The kernel over padded operands, x [Mp,Kp], xs [KBp,Mp,1], w [G,Np,Kp], ws [G,KBp,1,Np]: row
    tile i through group tile_group[i]'s weight (tile_valid[i] == 0: zeros) -> [Mp,Np]."""
    (mp, kp), (g, np_, _) = x.shape, w.shape
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    num_tiles, subs, kbp = mp // bm, bk // TILE, kp // TILE
    kw = dict(subs=subs, dot_dtype=bs.dot_dtype(be))
    if be.style == "tpu":
        in_specs = [pl.BlockSpec((bm, bk), lambda i, j, kk, tg, v: (i, kk * v[i])),
                    pl.BlockSpec((subs, bm, 1), lambda i, j, kk, tg, v: (kk * v[i], i, 0)),
                    pl.BlockSpec((None, bn, bk), lambda i, j, kk, tg, v: (tg[i], j, kk * v[i])),
                    pl.BlockSpec((None, subs, 1, bn), lambda i, j, kk, tg, v: (tg[i], kk * v[i], 0, j))]
        kernel = functools.partial(_tpu_kernel, **kw)
    else:
        w = w.reshape(g * np_, kp)
        ws = jnp.moveaxis(ws, 0, 2).reshape(kbp, 1, g * np_)
        in_specs = [pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                    pl.BlockSpec((kbp, bm, 1), lambda i, j: (0, i, 0)),
                    pl.BlockSpec((g * np_, kp), lambda i, j: (0, 0)),
                    pl.BlockSpec((kbp, 1, g * np_), lambda i, j: (0, 0, 0))]
        kernel = functools.partial(_triton_kernel, num_k=kp // bk, n_padded=np_, block_n=bn, **kw)
    call = row_tile_call(be, kernel, in_specs, name=name, num_tiles=num_tiles, block_m=bm, block_n=bn, n_padded=np_,
                         k_steps=kp // bk, out_dtype=out_dtype)
    return call(tile_group, tile_valid, x, xs, w, ws)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "backend", "interpret"))
def fp8_matmul(x_q, x_scale, w_q, w_scale, *, out_dtype=jnp.bfloat16,
               block_sizes: BlockSizes | None = None, backend=None, interpret=None):
    """x_q [M,K] e4m3, x_scale [M,KB] f32, w_q [N,K] e4m3, w_scale [NB,KB] or [N,KB] f32 -> [M,N].

    Partial edge blocks are zero padded inside; `backend`/`interpret` override the dispatcher.
    The grouped kernel's, with every row tile in the one group.
    """
    be = _backend.resolve(backend, interpret)
    bs = block_sizes or BlockSizes()
    bs.validate(be)
    if x_q.ndim != 2 or w_q.ndim != 2 or x_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"need x_q [M,K], w_q [N,K] with equal K; got {x_q.shape=}, {w_q.shape=}")
    check_scale_shapes("x_q", x_q, x_scale, 1)
    check_scale_shapes("w_q", w_q, w_scale, 1 if w_scale.shape[-2] == w_q.shape[-2] else TILE)  # per row or block
    (m, k), n = x_q.shape, w_q.shape[0]
    mp, np_, kp = round_up(m, bs.block_m), round_up(n, bs.block_n), round_up(k, bs.block_k)
    x, xs = pad_x_operands(x_q, x_scale, mp, kp)
    w, ws = pad_w_operands(w_q[None], w_scale[None], np_, kp)
    num_tiles = mp // bs.block_m
    out = tiled_call(be, bs, x, xs, w, ws, jnp.zeros((num_tiles,), jnp.int32), jnp.ones((num_tiles,), jnp.int32),
                     out_dtype, "fp8_matmul")
    return out[:m, :n]


def fp8_matmul_reference(x_q, x_scale, w_q, w_scale, *, out_dtype=jnp.bfloat16, **_):
    """Plain-jnp version of `fp8_matmul` (same signature, same promotion order)."""
    (m, k), n = x_q.shape, w_q.shape[0]
    kb = -(-k // TILE)
    x = pad_axis(x_q.astype(jnp.float32), 1, kb * TILE).reshape(m, kb, TILE)
    w = pad_axis(w_q.astype(jnp.float32), 1, kb * TILE).reshape(n, kb, TILE)
    part_MxNxKB = jnp.einsum("mbk,nbk->mnb", x, w, precision=lax.Precision.HIGHEST)
    ws_NxKB = rhs_row_scale(w_scale, n)
    return jnp.sum(part_MxNxKB * x_scale[:, None, :] * ws_NxKB[None], axis=-1).astype(out_dtype)

"""Grouped matmul (MoE experts, contiguous layout) over int8 / int4 weight-only quantized experts,
dequantised one weight tile at a time: rows [start_g, start_g + group_sizes[g]) of x use expert g.

Weights are [G, K, N] int8 (int4: packed two per byte, [G, K/2, N]; within each group of `group`
rows along K, packed row i holds row i in its low nibble and row i + group/2 in its high nibble)
with one fp32 scale per (group of rows, column): scale [G, K/group, N]. Each tile computes

    w_tile = (f32(q) * scale).astype(x.dtype);   acc += x_tile . w_tile  (fp32 accumulation)

which is what the plain-jnp `quant_grouped_matmul_reference` does per expert. Rows are laid out as
in `fp8_grouped_matmul` (each group's rows padded to `block_m`, a tile -> group map by scalar
prefetch on TPU, an ordinary input on Triton; unused tiles skipped). Rows beyond
sum(group_sizes) give 0. Letters: M rows, G groups (experts), K in, N out, Kq stored K rows.

Differentiable in x (QLoRA trains adapters over a frozen quantized base): the weights and scales
get zero cotangents, and dx = dy W_g^T (`quant_grouped_matmul_t`) walks K one quantization group
at a time, each group's rows of every expert dequantised and contracted by `ragged_dot` (sparse on
TPU/GPU), so no whole expert stack is ever held in x's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._backend import dot_f32, pad_axis, round_up
from pallas_kernels.fp8_grouped_matmul import grouped_rows_reference, tile_layout
from pallas_kernels.fp8_matmul import row_tile_call

FORMATS = ("int8", "int4")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """`block_k` is a multiple of the quantization group (whole groups per tile)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 256

    def validate(self, be: _backend.Backend, group: int) -> None:
        if self.block_k % group:
            raise ValueError(f"block_k={self.block_k} must be a multiple of {group=}")
        if group % 32:
            raise ValueError(f"{group=} must be a multiple of 32 (an int8 sublane tile; Triton dots of group/2 >= 16)")
        _backend.check_blocks(be, rows=("block_m",), lanes=("block_n",), block_m=self.block_m, block_n=self.block_n,
                              block_k=self.block_k)


def _nibbles(p_int8):
    """Signed (low, high) nibbles of packed int8 bytes, as int32 (arithmetic shifts sign-extend)."""
    p = p_int8.astype(jnp.int32)
    return lax.shift_right_arithmetic(lax.shift_left(p, 28), 28), lax.shift_right_arithmetic(p, 4)


def _dequant_parts(q_rows, scale_1xN, fmt, dtype):
    """One quantization group's weights times its scale row, in `dtype`, as a list of [rows, N] parts in
    K order: int8 one part, int4 its low then its high nibbles (packed [g/2, N] rows)."""
    parts = _nibbles(q_rows) if fmt == "int4" else (q_rows,)
    return [(vals.astype(jnp.float32) * scale_1xN.astype(jnp.float32)).astype(dtype) for vals in parts]


def _tpu_kernel(tg_ref, valid_ref, x_ref, q_ref, s_ref, o_ref, acc_ref, *, fmt, group):
    del tg_ref  # consumed by the index maps
    i, k, num_k = pl.program_id(0), pl.program_id(2), pl.num_programs(2)
    rows = group // 2 if fmt == "int4" else group

    def update(acc):
        x = x_ref[...]
        w_parts = []
        for j in range(s_ref.shape[0]):
            w_parts += _dequant_parts(q_ref[j * rows:(j + 1) * rows, :], s_ref[j], fmt, x.dtype)
        return acc + dot_f32(x, jnp.concatenate(w_parts, axis=0))  # x [bm, bk] . w [bk, bn]

    _backend.accumulate(acc_ref, o_ref, update, first=k == 0, last=k == num_k - 1, active=valid_ref[i] == 1)


def _triton_kernel(tg_ref, valid_ref, x_ref, q_ref, s_ref, o_ref, *, fmt, group, groups_per_expert, block_n):
    """One (row tile, column block): a loop over the expert's K groups, each dequantised then
    contracted (int4: its low and high halves as two dots, no concatenation)."""
    i, j = pl.program_id(0), pl.program_id(1)
    e = tg_ref[i]
    cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
    rows = group // 2 if fmt == "int4" else group

    def body(gi, acc):
        scale = s_ref[pl.ds(e * groups_per_expert + gi, 1), cols]
        q = q_ref[pl.ds((e * groups_per_expert + gi) * rows, rows), cols]
        for part, w in enumerate(_dequant_parts(q, scale, fmt, x_ref.dtype)):
            acc += jnp.dot(x_ref[:, pl.ds(gi * group + part * rows, rows)], w, preferred_element_type=jnp.float32)
        return acc

    acc0 = jnp.zeros((x_ref.shape[0], block_n), jnp.float32)
    o_ref[...] = lax.fori_loop(0, groups_per_expert * valid_ref[i], body, acc0).astype(o_ref.dtype)


def _check(x, w_q, w_scale, group_sizes, fmt, group):
    if fmt not in FORMATS:
        raise ValueError(f"{fmt=} must be one of {FORMATS}")
    if x.ndim != 2 or w_q.ndim != 3:
        raise ValueError(f"need x [M,K], w_q [G,Kq,N]; got {x.shape=}, {w_q.shape=}")
    k, (g, kq, n) = x.shape[1], w_q.shape
    if kq != (k // 2 if fmt == "int4" else k):
        raise ValueError(f"w_q has {kq} rows for K={k} ({fmt}{': packed two per byte' if fmt == 'int4' else ''})")
    if k % group:
        raise ValueError(f"K={k} must be a multiple of {group=}")
    if w_scale.shape != (g, k // group, n):
        raise ValueError(f"{w_scale.shape=} must be {(g, k // group, n)} (one scale per group of rows and column)")
    if group_sizes.shape != (g,):
        raise ValueError(f"{group_sizes.shape=} must be ({g},), one size per group")


@functools.partial(jax.jit, static_argnames=("fmt", "group", "out_dtype", "block_sizes", "backend", "interpret"))
def quant_grouped_matmul(x, w_q, w_scale, group_sizes, *, fmt: str, group: int, out_dtype=None,
                         block_sizes: BlockSizes | None = None, backend=None, interpret=None):
    """x [M,K] (bf16/f32), w_q [G,K,N] int8 or [G,K/2,N] uint8/int8 packed, w_scale [G,K/group,N] f32,
    group_sizes [G] -> [M,N] in `out_dtype` (default x's). Differentiable in x only (frozen weights)."""
    be = _backend.resolve(backend, interpret)
    bs = block_sizes or BlockSizes()
    _check(x, w_q, w_scale, group_sizes, fmt, group)
    bk = min(bs.block_k, round_up(x.shape[1], group))
    bs = dataclasses.replace(bs, block_k=bk if be.style == "tpu" else _backend.next_pow2(bk))
    bs.validate(be, group)
    return _frozen_weights_mm((fmt, group, out_dtype or x.dtype, bs, be), x, w_q, w_scale, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _frozen_weights_mm(static, x, w_q, w_scale, group_sizes):
    """The kernel; differentiable in x only (`_frozen_bwd`)."""
    fmt, group, out_dtype, bs, be = static
    (m, k), (g, _, n) = x.shape, w_q.shape
    q = lax.bitcast_convert_type(w_q, jnp.int8) if w_q.dtype == jnp.uint8 else w_q
    bm, bn = bs.block_m, bs.block_n
    np_ = round_up(n, bn)
    kp = round_up(k, bs.block_k)
    pack = 2 if fmt == "int4" else 1
    tiles = tile_layout(group_sizes, m, bm)
    xt = pad_axis(tiles.scatter(x), 1, kp)
    q = pad_axis(pad_axis(q, 1, kp // pack), 2, np_)  # padded rows: zero weights
    s = pad_axis(pad_axis(w_scale.astype(jnp.float32), 1, kp // group), 2, np_)
    if be.style == "tpu":
        rows, groups = bs.block_k // pack, bs.block_k // group
        in_specs = [pl.BlockSpec((bm, bs.block_k), lambda i, j, kk, tg, v: (i, kk * v[i])),
                    pl.BlockSpec((None, rows, bn), lambda i, j, kk, tg, v: (tg[i], kk * v[i], j)),
                    pl.BlockSpec((None, groups, 1, bn), lambda i, j, kk, tg, v: (tg[i], kk * v[i], 0, j))]
        kernel = functools.partial(_tpu_kernel, fmt=fmt, group=group)
        operands = (xt, q, s[:, :, None, :])
    else:
        gk = kp // group
        in_specs = [pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                    pl.BlockSpec((g * kp // pack, np_), lambda i, j: (0, 0)),
                    pl.BlockSpec((g * gk, np_), lambda i, j: (0, 0))]
        kernel = functools.partial(_triton_kernel, fmt=fmt, group=group, groups_per_expert=gk, block_n=bn)
        operands = (xt, q.reshape(g * kp // pack, np_), s.reshape(g * gk, np_))
    call = row_tile_call(be, kernel, in_specs, name=f"{fmt}_grouped_matmul", num_tiles=tiles.num_tiles, block_m=bm,
                         block_n=bn, n_padded=np_, k_steps=kp // bs.block_k, out_dtype=out_dtype)
    out = call(tiles.tile_group, tiles.tile_valid, *operands)
    return tiles.gather(out[:, :n])


def _frozen_fwd(static, x, w_q, w_scale, group_sizes):
    y = _frozen_weights_mm(static, x, w_q, w_scale, group_sizes)
    return y, (jnp.zeros((0,), x.dtype), w_q, w_scale, group_sizes)  # x's dtype only: the weights are all dx needs


def _frozen_bwd(static, res, dy_MxN):
    """dx = dy W^T per row's group; the frozen weights' (and the sizes') cotangents are zero."""
    fmt, group = static[:2]
    x_like, w_q, w_scale, group_sizes = res
    dx = quant_grouped_matmul_t(dy_MxN.astype(x_like.dtype), w_q, w_scale, group_sizes, fmt=fmt, group=group)
    return dx, None, None, None


_frozen_weights_mm.defvjp(_frozen_fwd, _frozen_bwd)


def quant_grouped_matmul_t(dy_MxN, w_q, w_scale, group_sizes, *, fmt: str, group: int):
    """dy [M,N] . W_g^T -> [M,K] in dy's dtype (fp32 accumulation): the x-gradient of
    `quant_grouped_matmul`. One quantization group of K at a time: its rows of every expert
    dequantised ([G, group, N]) and contracted by `ragged_dot`; rows beyond sum(group_sizes) give 0."""
    m, kq = dy_MxN.shape[0], w_q.shape[1]
    rows = group // 2 if fmt == "int4" else group

    def k_group(j):  # columns [j*group, (j+1)*group) of dx
        q_j = lax.dynamic_slice_in_dim(w_q, j * rows, rows, axis=1)
        w_GxgxN = dequantize_reference(q_j, lax.dynamic_slice_in_dim(w_scale, j, 1, axis=1), fmt=fmt, group=group,
                                       dtype=dy_MxN.dtype)
        return lax.ragged_dot(dy_MxN, jnp.swapaxes(w_GxgxN, 1, 2), group_sizes.astype(jnp.int32),
                              preferred_element_type=jnp.float32).astype(dy_MxN.dtype)

    parts_JxMxg = lax.map(k_group, jnp.arange(kq // rows))
    return jnp.moveaxis(parts_JxMxg, 0, 1).reshape(m, kq // rows * group)


def dequantize_reference(w_q, w_scale, *, fmt: str, group: int, dtype):
    """[..., K, N] in `dtype` from int8 [..., K, N] or packed [..., K/2, N] and scales [..., K/group, N]."""
    q = lax.bitcast_convert_type(w_q, jnp.int8) if w_q.dtype == jnp.uint8 else w_q
    if fmt == "int4":
        *lead, kh, n = q.shape
        lo, hi = _nibbles(q.reshape(*lead, kh // (group // 2), group // 2, n))
        q = jnp.concatenate([lo, hi], axis=-2).reshape(*lead, kh * 2, n)
    return (q.astype(jnp.float32) * jnp.repeat(w_scale.astype(jnp.float32), group, axis=-2)).astype(dtype)


def quant_grouped_matmul_reference(x, w_q, w_scale, group_sizes, *, fmt: str, group: int, out_dtype=None, **_):
    """Plain jnp, same numerics: each expert's weight dequantised to x's dtype, x . w in fp32, the
    rows of each group kept."""
    _check(x, w_q, w_scale, group_sizes, fmt, group)

    def dense(gi):
        w = dequantize_reference(w_q[gi], w_scale[gi], fmt=fmt, group=group, dtype=x.dtype)
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    out = grouped_rows_reference(dense, group_sizes, x.shape[0], w_q.shape[2], w_q.shape[0])
    return out.astype(out_dtype or x.dtype)

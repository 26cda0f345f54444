"""The device report's kernel rows: each Pallas kernel beside the XLA form that runs when it is
off, at the 671B's shapes (or tiny ones for the CPU smoke run), on one set of inputs.

A case's two functions take the same argument tuple (each reads the arrays it needs), so that one
call of each gives the relative error between them. FLOPs count the matmuls' multiply-adds as 2;
bytes count each operand read once and the output written once, for each implementation's own
operands (an 8-bit weight is 1 byte an element, a bf16 one 2).
Letters: M rows, K contraction, N output features, G experts, B batch, T prompt, S cache slots,
H heads, C latent (kv_lora_rank), R rope dim.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from dsv3_jax.ops import attention, latent_attention, quant
from pallas_kernels.quant_grouped_matmul import dequantize_reference, quant_grouped_matmul

BF16, F32 = jnp.bfloat16, jnp.float32


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    gemm_MxKxN: tuple[int, int, int] = (4096, 7168, 4096)  # tokens x hidden x out features
    experts: int = 256  # G
    expert_rows: int = 8192 * 8  # M: 8192 tokens x top-8, an even 256 rows per expert
    expert_KxN: tuple[int, int] = (7168, 2048)  # hidden x moe_intermediate (w1 / w3)
    quant_group: int = 128  # int8 / int4 rows of K per scale
    prefill_BxTxH: tuple[int, int, int] = (1, 4096, 128)
    qk_v: tuple[int, int] = (192, 128)  # q/k head dim (nope 128 + rope 64), v head dim
    decode_BxSxH: tuple[int, int, int] = (64, 32768, 128)
    latent_CxR: tuple[int, int] = (512, 64)


SMOKE_SHAPES = KernelShapes(gemm_MxKxN=(128, 256, 128), experts=4, expert_rows=256, expert_KxN=(256, 128),
                            prefill_BxTxH=(1, 128, 2), decode_BxSxH=(2, 256, 2), latent_CxR=(128, 16))


class Impl(NamedTuple):
    fn: Callable  # jitted (*case.args) -> output
    bytes: float


class KernelCase(NamedTuple):
    shape: str  # the shapes, one line
    args: tuple
    pallas: Impl
    xla: Impl
    xla_form: str  # what the XLA side runs
    flops: float
    fp8: bool  # compute measured against the fp8 peak


def _normal(key, shape, dtype=BF16):
    return jax.jit(lambda k: jax.random.normal(k, shape, F32).astype(dtype))(key)


def _keys(seed: int, n: int):
    return jax.random.split(jax.random.key(seed), n)


def fp8_gemm(sh: KernelShapes) -> KernelCase:
    """Block-scaled FP8 GEMM (1x128 activation tiles, 128x128 weight blocks) against its jnp twin,
    the form `dsv3_jax/ops/linear.py:_matmul` lowers where the kernel is off (CPU)."""
    m, k, n = sh.gemm_MxKxN
    kx, kw = _keys(0, 2)
    args = (*pk.quantize_1x128(_normal(kx, (m, k), F32)), *pk.quantize_128x128(_normal(kw, (n, k), F32)))
    bytes_ = m * k + n * k + 2 * m * n
    return KernelCase(f"M={m} K={k} N={n}", args,
                      Impl(jax.jit(lambda *a: pk.fp8_matmul(*a, out_dtype=BF16)), bytes_),
                      Impl(jax.jit(lambda *a: pk.fp8_matmul_reference(*a, out_dtype=BF16)), bytes_),
                      "pallas_kernels.fp8_matmul_reference (ops/linear.py:_matmul's CPU branch)",
                      2 * m * k * n, fp8=True)


def _expert_rows(sh: KernelShapes):
    """(x [M, K] bf16, w [G, K, N] bf16, sizes [G] int32: the rows split evenly over the experts)."""
    (k, n), g, m = sh.expert_KxN, sh.experts, sh.expert_rows
    kx, kw = _keys(1, 2)
    sizes = jnp.full((g,), m // g, jnp.int32)
    return _normal(kx, (m, k)), _normal(kw, (g, k, n)), sizes


def _ragged(x_MxK, w_GxKxN, sizes_G):
    return jax.lax.ragged_dot(x_MxK, w_GxKxN, sizes_G, preferred_element_type=F32).astype(BF16)


def fp8_grouped(sh: KernelShapes) -> KernelCase:
    """The FP8 grouped kernel (experts, the FP8 recipe's Fprop) against `ragged_dot` on the bf16
    operands: the library's expert matmul with `fp8_matmul` off. The error is FP8's rounding."""
    x, w, sizes = _expert_rows(sh)
    (k, n), g, m = sh.expert_KxN, sh.experts, sh.expert_rows
    w_q, w_s = jax.jit(lambda w: jax.lax.map(lambda e: pk.quantize_128x128(e.T.astype(F32)), w))(w)
    args = (*pk.quantize_1x128(x.astype(F32)), w_q, w_s, sizes, x, w)
    kernel = jax.jit(lambda xq, xs, wq, ws, s, *_: pk.fp8_grouped_matmul(xq, xs, wq, ws, s, out_dtype=BF16))
    return KernelCase(f"G={g} M={m} K={k} N={n}", args, Impl(kernel, m * k + g * k * n + 2 * m * n),
                      Impl(jax.jit(lambda xq, xs, wq, ws, s, x, w: _ragged(x, w, s)), 2 * (m * k + g * k * n + m * n)),
                      "jax.lax.ragged_dot on bf16 x and w (fp8_matmul=False)", 2 * m * k * n, fp8=True)


def int_grouped(fmt: str, sh: KernelShapes) -> KernelCase:
    """The int8 / int4 weight-only grouped kernel (a weight tile dequantised at a time) against the
    whole stack dequantised to bf16, then `ragged_dot`. Same numerics: the error is rounding order."""
    x, w, sizes = _expert_rows(sh)
    (k, n), g, m, group = sh.expert_KxN, sh.experts, sh.expert_rows, sh.quant_group
    w_q, w_s = jax.jit(lambda w: jax.lax.map(lambda e: quant.quantize_int(e, fmt, group), w))(w)
    del w
    stored = g * k * n // (2 if fmt == "int4" else 1) + g * (k // group) * n * 4
    kernel = jax.jit(lambda x, q, s, sz: quant_grouped_matmul(x, q, s, sz, fmt=fmt, group=group, out_dtype=BF16))
    dequant = jax.jit(lambda x, q, s, sz: _ragged(x, dequantize_reference(q, s, fmt=fmt, group=group, dtype=BF16), sz))
    io = 2 * (m * k + m * n)
    return KernelCase(f"G={g} M={m} K={k} N={n} group={group}", (x, w_q, w_s, sizes), Impl(kernel, io + stored),
                      Impl(dequant, io + stored + 2 * 2 * g * k * n),
                      "dequantize_reference to bf16, then jax.lax.ragged_dot", 2 * m * k * n, fp8=False)


def _prefill_args(sh: KernelShapes):
    (b, t, h), (qk, v) = sh.prefill_BxTxH, sh.qk_v
    kq, kk, kv = _keys(2, 3)
    return (_normal(kq, (b, t, h, qk)), _normal(kk, (b, t, h, qk)), _normal(kv, (b, t, h, v)))


def _prefill_counts(sh: KernelShapes):
    """(causal FLOPs of one forward: half the T x T scores and weighted sums, q k v o bytes in bf16)."""
    (b, t, h), (qk, v) = sh.prefill_BxTxH, sh.qk_v
    return 2 * b * h * t * t * (qk + v) / 2, 2 * b * t * h * (2 * qk + 2 * v)


def mla_prefill(sh: KernelShapes) -> KernelCase:
    """The flash MLA prefill kernel's forward against `ops/attention.py:attention` (causal, query
    blocks against the keys up to their last row): `attention_impl` pallas vs xla."""
    scale, (flops, bytes_) = sh.qk_v[0] ** -0.5, _prefill_counts(sh)
    pallas = jax.jit(lambda q, k, v: pk.mla_prefill(q, k, v, softmax_scale=scale))
    xla = jax.jit(lambda q, k, v: attention.attention(q, k, v, softmax_scale=scale))
    (b, t, h), (qk, v) = sh.prefill_BxTxH, sh.qk_v
    return KernelCase(f"B={b} T={t} H={h} qk={qk} v={v}", _prefill_args(sh), Impl(pallas, bytes_),
                      Impl(xla, bytes_), "dsv3_jax.ops.attention.attention", flops, fp8=False)


def _grads(fn):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(F32)), (0, 1, 2)))


def mla_prefill_bwd(sh: KernelShapes) -> KernelCase:
    """Forward and backward (dq, dk, dv) of the same two, as a train step runs them. FLOPs: 3 x the
    forward's (the backward's recomputed scores not counted); bytes: q k v o read, dq dk dv do
    written and read, 3 x the forward's."""
    scale, (flops, bytes_) = sh.qk_v[0] ** -0.5, _prefill_counts(sh)
    case = mla_prefill(sh)
    pallas = _grads(lambda q, k, v: pk.mla_prefill(q, k, v, softmax_scale=scale))
    xla = _grads(lambda q, k, v: attention.attention(q, k, v, softmax_scale=scale))
    return case._replace(pallas=Impl(pallas, 3 * bytes_), xla=Impl(xla, 3 * bytes_), flops=3 * flops)


def mla_decode(cache_dtype: str, sh: KernelShapes) -> KernelCase:
    """One absorbed decode step over a full cache (every row at position S): the split-KV Pallas
    kernel (`latent_attention.attend_pallas`) against the XLA block loop (`latent_attention.attend`),
    both merged with the token's own entry. The cache in bf16, or fp8 with a scale per 128 latent
    values and a bf16 rope key (`latent_attention.encode`)."""
    (b, s, h), (c, r) = sh.decode_BxSxH, sh.latent_CxR
    ks = _keys(3, 6)
    cache = jax.jit(lambda lat, pe: latent_attention.encode(lat, pe, cache_dtype))(_normal(ks[0], (b, s, c)),
                                                                                 _normal(ks[1], (b, s, r)))
    args = (_normal(ks[2], (b, 1, h, c)), _normal(ks[3], (b, 1, h, r)), cache,
            (_normal(ks[4], (b, 1, c)), _normal(ks[5], (b, 1, r))), jnp.full((b, 1), s, jnp.int32))
    kw = dict(softmax_scale=sh.qk_v[0] ** -0.5, compute_dtype=BF16)
    bytes_ = sum(a.size * a.dtype.itemsize for a in cache if a is not None)  # the cache, read once
    return KernelCase(f"B={b} S={s} H={h} C={c} R={r} cache={cache_dtype}", args,
                      Impl(jax.jit(lambda *a: latent_attention.attend_pallas(*a, **kw)), bytes_),
                      Impl(jax.jit(lambda *a: latent_attention.attend(*a, **kw)), bytes_),
                      "dsv3_jax.ops.latent_attention.attend", 2 * b * h * s * (2 * c + r), fp8=False)

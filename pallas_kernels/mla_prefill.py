"""Causal flash attention for MLA prefill/training (Dqk != Dv), document-aware, with a
recomputation-based flash backward (FlashAttention-2 style) behind `jax.custom_vjp`.

A query at position t attends to keys s <= t with segment_ids[s] == segment_ids[t]. KV blocks
entirely above the causal diagonal are skipped (TPU: clamped block indices, no DMA).
Letters: B batch, T length, H heads, K = Dqk (192 in V3: nope 128 + rope 64), V = Dv (128).

All three kernels (forward, dq, dk/dv) share one driver, `_flash_call`: an *outer* block
(rows of the output) reduces over a range of *inner* blocks. TPU style puts the inner index on
the last grid axis with VMEM scratch; Triton style loops in-kernel over a full-length ref.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _backend
from pallas_kernels._backend import dot_f32, pad_axis, round_up


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query / key block lengths (forward and backward share them)."""

    block_q: int = 128
    block_k: int = 128

    @classmethod
    def default(cls, be: _backend.Backend) -> "BlockSizes":
        """TPU: 128 x 128. Triton: 64 x 64, since 128 x 128 blocks with Dqk padded to 256 need more
        shared memory than a Hopper GPU has (docs/benchmarks.md, Kernel choices)."""
        return cls(64, 64) if be.style == "triton" else cls()

    def validate(self, be: _backend.Backend) -> None:
        block_q, block_k = self.block_q, self.block_k
        if max(block_q, block_k) % min(block_q, block_k):
            raise ValueError(f"{block_q=} and {block_k=} must divide one another")
        _backend.check_blocks(be, rows=("block_q",), lanes=("block_k",), block_q=block_q, block_k=block_k)


def _spec(shape, blk, where: Callable):
    """BlockSpec of a [B, H|1, T, X] operand, cut along T (rows), or of [B, 1, 1, T] key segment ids,
    cut along their last axis (lanes), in blocks of `blk`; where(*grid ids) -> (b, h, T block). T >= 8
    after padding, so the two never coincide; a [B, 1, ...] operand serves every head."""
    keys = shape[2] == 1

    def index(*grid_ids):
        b, h, seq_idx = where(*grid_ids)
        h = h if shape[1] > 1 else 0
        return (b, h, 0, seq_idx) if keys else (b, h, seq_idx, 0)

    return pl.BlockSpec((None, None, 1, blk) if keys else (None, None, blk, shape[3]), index)


def _slice(ref, idx, blk):
    start = pl.multiple_of(idx * blk, blk)
    return ref[:, pl.ds(start, blk)] if ref.shape[0] == 1 else ref[pl.ds(start, blk), :]


def _flash_call(be, *, name, step, init, finish, outer, inner, out_shapes, outer_blk, inner_blk,
                inner_range: Callable):
    """Runs `finish(fold(step, inner blocks in inner_range(o)), outer)` for every outer block.

    outer/inner: sequences of [B, H|1, T, X] or [B, 1, 1, T] arrays; out_shapes: [B,H,T,X]
    ShapeDtypeStructs blocked like the outer rows; init() -> tuple of fp32 carries;
    step(carry, outer_vals, inner_vals, o, i). The grid's B, H, T are those of outer[0].
    """
    b, h, t = outer[0].shape[:3]
    n_outer, n_inner = t // outer_blk, t // inner_blk
    n_o, n_i, n_out = len(outer), len(inner), len(out_shapes)
    carry_shapes = [c.shape for c in jax.eval_shape(init)]
    if be.style == "tpu":
        def at_inner(bi, hi_, o, i):  # clamped into inner_range(o): a skipped block issues no DMA
            lo, hi = inner_range(o)
            return bi, hi_, jnp.clip(i, lo, jnp.maximum(hi - 1, lo))

        at_outer = lambda bi, hi_, o, i: (bi, hi_, o)  # noqa: E731
        inner_spec_blk = inner_blk

        def kernel(*refs):
            o_refs, i_refs = refs[:n_o], refs[n_o:n_o + n_i]
            out_refs, scr = refs[n_o + n_i:n_o + n_i + n_out], refs[n_o + n_i + n_out:]
            o, i = pl.program_id(2), pl.program_id(3)
            lo, hi = inner_range(o)

            @pl.when(i == 0)
            def _():
                for r, v in zip(scr, init()):
                    r[...] = v

            @pl.when((i >= lo) & (i < hi))
            def _():
                carry = step(tuple(r[...] for r in scr), [r[...] for r in o_refs],
                             [r[...] for r in i_refs], o, i)
                for r, v in zip(scr, carry):
                    r[...] = v

            @pl.when(i == n_inner - 1)
            def _():
                for r, v in zip(out_refs, finish(tuple(r[...] for r in scr), [r[...] for r in o_refs])):
                    r[...] = v.astype(r.dtype)

        grid = (b, h, n_outer, n_inner)
        scratch = [pltpu.VMEM(s, jnp.float32) for s in carry_shapes]
    else:
        at_outer = lambda o, bi, hi_: (bi, hi_, o)  # noqa: E731
        at_inner = lambda o, bi, hi_: (bi, hi_, 0)  # noqa: E731
        inner_spec_blk = t  # the whole length, read block by block in the kernel's loop

        def kernel(*refs):
            o_refs, i_refs, out_refs = refs[:n_o], refs[n_o:n_o + n_i], refs[n_o + n_i:]
            o = pl.program_id(0)
            o_vals = [r[...] for r in o_refs]
            lo, hi = inner_range(o)

            def body(i, carry):
                i_vals = [_slice(r, i, inner_blk) for r in i_refs]
                return step(carry, o_vals, i_vals, o, i)

            carry = lax.fori_loop(lo, hi, body, init())
            for r, v in zip(out_refs, finish(carry, o_vals)):
                r[...] = v.astype(r.dtype)

        grid, scratch = (n_outer, b, h), []
    in_specs = [_spec(a.shape, outer_blk, at_outer) for a in outer]
    in_specs += [_spec(a.shape, inner_spec_blk, at_inner) for a in inner]
    out_specs = [_spec(o.shape, outer_blk, at_outer) for o in out_shapes]
    return _backend.pallas_call(be, kernel, name=name, out_shape=list(out_shapes), grid=grid, in_specs=in_specs,
                                out_specs=out_specs, scratch_shapes=scratch)(*outer, *inner)


def _scores(q, k, q_seg, k_seg, q0, k0, scale):
    """Scaled scores [bq,bk] (fp32) and the causal + same-segment mask."""
    s = dot_f32(q, k, "NT") * scale
    q_pos = q0 + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    k_pos = k0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return s, (k_pos <= q_pos) & (q_seg == k_seg)


def _dot(a, b, form: str = "NN"):
    """`dot_f32` with a cast to b's dtype (probabilities and score gradients are fp32)."""
    return dot_f32(a.astype(b.dtype), b, form)


def _fwd_step(carry, outer, inner, o, i, *, cfg):
    (q, q_seg), (k, v, k_seg) = outer, inner
    s, mask = _scores(q, k, q_seg, k_seg, o * cfg.bq, i * cfg.bk, cfg.scale)
    return _backend.online_softmax_step(carry, s, mask, lambda p: _dot(p, v))


def _fwd_finish(carry, outer):
    m, l, acc = carry
    l_safe = jnp.where(l > 0, l, 1.0)
    return acc / l_safe, m + jnp.log(l_safe)


def _probs_and_ds(q_side, kv_side, q0, k0, scale):
    """The backward's recomputed probabilities P and score gradients dS = P * (dO . V^T - delta) of a
    (q block, kv block), [bq,bk] fp32 each."""
    (q, q_seg, do, lse, delta), (k, v, k_seg) = q_side, kv_side
    s, mask = _scores(q, k, q_seg, k_seg, q0, k0, scale)
    p = jnp.where(mask, jnp.exp(s - lse), 0.0)
    return p, p * (dot_f32(do, v, "NT") - delta)


def _dq_step(carry, outer, inner, o, i, *, cfg):
    (dq,), (k, _, _) = carry, inner
    _, ds = _probs_and_ds(outer, inner, o * cfg.bq, i * cfg.bk, cfg.scale)
    return (dq + _dot(ds, k),)


def _dkv_step(carry, outer, inner, o, i, *, cfg):
    (dk, dv), (q, _, do, _, _) = carry, inner
    p, ds = _probs_and_ds(inner, outer, i * cfg.bq, o * cfg.bk, cfg.scale)
    return dk + _dot(ds, q, "TN"), dv + _dot(p, do, "TN")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    bq: int
    bk: int
    be: _backend.Backend


def _causal_hi(o, bq, bk, n_k):  # kv blocks [0, hi) touch q block o
    return jnp.minimum(pl.cdiv((o + 1) * bq, bk), n_k)


def _forward(q, k, v, q_seg, k_seg, cfg: _Cfg):
    b, h, t, dk = q.shape
    dv = v.shape[3]
    return _flash_call(
        cfg.be, name="mla_prefill_fwd", step=functools.partial(_fwd_step, cfg=cfg),
        init=lambda: _backend.online_softmax_init(cfg.bq, dv),
        finish=_fwd_finish, outer=[q, q_seg], inner=[k, v, k_seg],
        out_shapes=[jax.ShapeDtypeStruct((b, h, t, dv), q.dtype),
                    jax.ShapeDtypeStruct((b, h, t, 1), jnp.float32)],
        outer_blk=cfg.bq, inner_blk=cfg.bk, inner_range=lambda o: (0, _causal_hi(o, cfg.bq, cfg.bk, t // cfg.bk)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, k_seg, cfg: _Cfg):
    return _forward(q, k, v, q_seg, k_seg, cfg)[0]


def _flash_fwd(q, k, v, q_seg, k_seg, cfg):
    o, lse = _forward(q, k, v, q_seg, k_seg, cfg)
    return o, (q, k, v, q_seg, k_seg, o, lse)


def _flash_bwd(cfg: _Cfg, res, do):
    q, k, v, q_seg, k_seg, o, lse = res
    t, d_qk = q.shape[2:]
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
    do = do.astype(q.dtype)
    q_side, kv_side = [q, q_seg, do, lse, delta], [k, v, k_seg]
    (dq,) = _flash_call(
        cfg.be, name="mla_prefill_dq", step=functools.partial(_dq_step, cfg=cfg),
        init=lambda: (jnp.zeros((cfg.bq, d_qk), jnp.float32),),
        finish=lambda c, _: (c[0] * cfg.scale,), outer=q_side, inner=kv_side,
        out_shapes=[jax.ShapeDtypeStruct(q.shape, q.dtype)], outer_blk=cfg.bq, inner_blk=cfg.bk,
        inner_range=lambda o: (0, _causal_hi(o, cfg.bq, cfg.bk, t // cfg.bk)))
    dk, dv = _flash_call(
        cfg.be, name="mla_prefill_dkv", step=functools.partial(_dkv_step, cfg=cfg),
        init=lambda: (jnp.zeros((cfg.bk, d_qk), jnp.float32),
                      jnp.zeros((cfg.bk, v.shape[3]), jnp.float32)),
        finish=lambda c, _: (c[0] * cfg.scale, c[1]), outer=kv_side, inner=q_side,
        out_shapes=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        outer_blk=cfg.bk, inner_blk=cfg.bq,
        inner_range=lambda o: (lax.div(o * cfg.bk, cfg.bq), t // cfg.bq))  # lax.div: no sign op
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "block_sizes", "backend",
                                             "interpret", "return_lse"))
def mla_prefill(q, k, v, *, softmax_scale: float, segment_ids=None,
                block_sizes: BlockSizes | None = None, backend=None, interpret=None, return_lse: bool = False):
    """q [B,T,H,K], k [B,T,H,K], v [B,T,H,V], segment_ids int32 [B,T] | None -> [B,T,H,V].

    Differentiable in q, k, v (Pallas backward). T and head dims are padded internally.
    With `return_lse` (forward only, not differentiable): (out, log-normaliser [B,T,H] float32).
    """
    be = _backend.resolve(backend, interpret)
    bs = block_sizes or BlockSizes.default(be)
    bs.validate(be)
    b, t, h, d_qk = q.shape
    if k.shape != q.shape or v.shape[:3] != (b, t, h):
        raise ValueError(f"need q, k [B,T,H,K] and v [B,T,H,V]; got {q.shape=}, {k.shape=}, "
                         f"{v.shape=}")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"{segment_ids.shape=} must be ({b}, {t})")
    tp = round_up(t, max(bs.block_q, bs.block_k))
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    seg = pad_axis(seg, 1, tp, value=-1)  # padded keys sit after every real query: causally masked
    to_bhtd = lambda x: pad_axis(pad_axis(jnp.transpose(x, (0, 2, 1, 3)), 2, tp), 3,
                                 _backend.pad_feature(be, x.shape[3]))
    cfg = _Cfg(float(softmax_scale), bs.block_q, bs.block_k, be)
    args = (to_bhtd(q), to_bhtd(k), to_bhtd(v), seg[:, None, :, None], seg[:, None, None, :], cfg)
    o, lse = _forward(*args) if return_lse else (_flash(*args), None)
    o = jnp.transpose(o[:, :, :t, :v.shape[3]], (0, 2, 1, 3))
    return (o, jnp.transpose(lse[:, :, :t, 0], (0, 2, 1))) if return_lse else o


def mla_prefill_reference(q, k, v, *, softmax_scale: float, segment_ids=None, **_):
    """Plain-jnp `mla_prefill`: materialised causal (+ segment) softmax attention in fp32."""
    t = q.shape[1]
    s_BxHxTxS = jnp.einsum("bthk,bshk->bhts", q.astype(jnp.float32), k.astype(jnp.float32),
                           precision=lax.Precision.HIGHEST) * softmax_scale
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    p = jax.nn.softmax(jnp.where(mask, s_BxHxTxS, -jnp.inf), axis=-1)
    out = jnp.einsum("bhts,bshv->bthv", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype)

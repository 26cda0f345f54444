"""Absorbed MLA decode over only the cache rows each query selected (DeepSeek Sparse Attention).

For the entries i = indices[b,k] >= 0 (the top-k tokens the indexer picked, -1 = no entry):
scores[b,h,k] = (q_latent[b,h] . kv_latent[b,i] + q_pe[b,h] . k_pe[b,i]) * softmax_scale and
out[b,h] = softmax_k(scores) @ kv_latent[b, indices[b]], so a step reads K rows of the cache
whatever its length. Entries outside [0, S) count as no entry; a repeated index counts once per
appearance (top-k indices are distinct). A row with no entry gives out 0 and lse -inf.

The K entries are cut into `num_splits` splits, each a partial output + LSE over its share, merged
by their LSEs as `mla_decode` merges its cache splits; within a split, blocks of `block_k`
entries run an online softmax. How a block's rows are gathered:

- TPU: the cache stays in HBM (`pl.ANY`); each block's rows are fetched by one DMA per row
  (latent, rope key and, for a quantised cache, scales) into a double-buffered VMEM block, the
  next block's DMAs in flight while this block computes. The split's indices arrive in SMEM;
  entries of -1 issue no DMA.
- Triton: each block's indices are loaded as a vector and its rows gathered by one pointer load
  per block ([block_k, R]); -1 entries read row 0 and are masked. (Mosaic GPU, which this package
  does not use, lowers no vector-indexed ref load in jax 0.10: it would need one copy per row.)

Quantised caches: with `kv_scale` [B,S,G] (one fp32 scale per 128 latent values, G = ceil(R/128)),
`kv_latent` is e4m3 or int8 (an int8 cache's per-token scale repeated over its G groups) and each
gathered block is dequantised on chip. The cache is never copied unless R or P need padding for
the style (Triton: powers of two; quantised: R a multiple of 128); the 671B's 512 / 64 need none.

Letters: B batch, H heads, R latent rank (kv_lora), P rope dim, S cache length, K selected entries.
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
from pallas_kernels._backend import pad_axis, round_up
from pallas_kernels.mla_decode import _combine_splits, _dequant, _finish, _init, _online_step


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """`block_k` selected entries per step (None: 128 on TPU, a lane tile; 64 on Triton, the token
    block of DeepSeek's sparse kernels); `num_splits` splits of the K entries (None: up to 8, by K);
    `block_h` heads per Triton program (None: 16, as in `mla_decode`)."""

    block_k: int | None = None
    num_splits: int | None = None
    block_h: int | None = None

    def validate(self, be: _backend.Backend) -> None:
        _backend.check_blocks(be, lanes=("block_k",), block_k=self.block_k_for(be))
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")
        if self.block_h is not None and (self.block_h < 16 or self.block_h != _backend.next_pow2(self.block_h)):
            raise ValueError(f"{self.block_h=} must be a power of two >= 16")

    def block_k_for(self, be: _backend.Backend) -> int:
        return self.block_k or (128 if be.style == "tpu" else 64)


def _row_dmas(b, idx_ref, first, slot, hbm_refs, buf_refs, sem, block_k, start: bool):
    """Starts (or waits for) the DMAs that gather rows idx_ref[0, first : first + block_k] of batch
    row b of each HBM array into `slot` of its VMEM buffer; -1 entries move nothing."""
    def one_row(i, carry):
        row = idx_ref[0, first + i]

        @pl.when(row >= 0)
        def _():
            for a, (src, dst) in enumerate(zip(hbm_refs, buf_refs)):
                copy = pltpu.make_async_copy(src.at[b, pl.ds(row, 1)], dst.at[slot, pl.ds(i, 1)], sem.at[a, slot])
                copy.start() if start else copy.wait()
        return carry

    lax.fori_loop(0, block_k, one_row, 0)


def _tpu_kernel(idx_smem, idx_vmem, ql_ref, qp_ref, *refs, scale, block_k, blocks_per_split, quantized):
    n = 3 if quantized else 2
    hbm, bufs = refs[:n], refs[n + 2:2 * n + 2]
    o_ref, lse_ref = refs[n:n + 2]
    sem, m_ref, l_ref, acc_ref = refs[2 * n + 2:]
    b, j = pl.program_id(0), pl.program_id(2)
    fetch = functools.partial(_row_dmas, b, idx_smem, hbm_refs=hbm, buf_refs=bufs, sem=sem, block_k=block_k)

    @pl.when(j == 0)
    def _():
        m_ref[...], l_ref[...], acc_ref[...] = _init(*acc_ref.shape)
        for buf in bufs:  # -1 entries leave their rows unwritten: zeros, never stale NaN bits
            buf[...] = jnp.zeros_like(buf)
        fetch(0, 0, start=True)

    @pl.when(j + 1 < blocks_per_split)
    def _():
        fetch((j + 1) * block_k, (j + 1) % 2, start=True)

    slot = j % 2
    fetch(j * block_k, slot, start=False)
    kv = _dequant(bufs[0][slot], bufs[2][slot] if quantized else None, ql_ref.dtype)
    carry = _online_step((m_ref[...], l_ref[...], acc_ref[...]), ql_ref[...], qp_ref[...], kv, bufs[1][slot],
                         idx_vmem[...] >= 0, scale)
    m_ref[...], l_ref[...], acc_ref[...] = carry

    @pl.when(j == blocks_per_split - 1)
    def _():
        _finish(carry, o_ref, lse_ref)


def _triton_kernel(idx_ref, ql_ref, qp_ref, kv_ref, kp_ref, *refs, scale, block_k, blocks_per_split, quantized):
    sc_ref, (o_ref, lse_ref) = (refs[0], refs[1:]) if quantized else (None, refs)
    split = pl.program_id(1)
    q_lat, q_pe = ql_ref[...], qp_ref[...]

    def body(j, carry):
        idx = idx_ref[pl.ds((split * blocks_per_split + j) * block_k, block_k)]
        valid = idx >= 0
        rows = jnp.where(valid, idx, 0)
        kv = _dequant(kv_ref[rows, :], None if sc_ref is None else sc_ref[rows, :], q_lat.dtype)
        kv = jnp.where(valid[:, None], kv, jnp.zeros_like(kv))
        return _online_step(carry, q_lat, q_pe, kv, kp_ref[rows, :], valid[None, :], scale)

    _finish(lax.fori_loop(0, blocks_per_split, body, _init(*o_ref.shape)), o_ref, lse_ref)


def _check_shapes(q_latent, q_pe, kv_latent, k_pe, indices, kv_scale):
    b, h, r = q_latent.shape
    s, p = kv_latent.shape[1], q_pe.shape[2]
    if q_pe.shape[:2] != (b, h) or kv_latent.shape != (b, s, r) or k_pe.shape != (b, s, p):
        raise ValueError(f"inconsistent shapes: {q_latent.shape=}, {q_pe.shape=}, "
                         f"{kv_latent.shape=}, {k_pe.shape=}; want [B,H,R], [B,H,P], [B,S,R], [B,S,P]")
    if indices.ndim != 2 or indices.shape[0] != b or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be integer [B={b}, K], got {indices.dtype} {indices.shape}")
    if kv_scale is not None and kv_scale.shape != (b, s, -(-r // 128)):
        raise ValueError(f"{kv_scale.shape=} must be ({b}, {s}, {-(-r // 128)}): one scale per 128 latent values")


@functools.partial(jax.jit, static_argnames=("softmax_scale", "block_sizes", "backend", "interpret"))
def sparse_mla_decode(q_latent_BxHxR, q_pe_BxHxP, kv_latent_BxSxR, k_pe_BxSxP, indices_BxK, *,
                      softmax_scale: float, kv_scale=None, block_sizes: BlockSizes | None = None,
                      backend=None, interpret=None):
    """-> (out [B,H,R] f32, lse [B,H] f32): absorbed MLA decode over the cache rows named by
    `indices_BxK` (int32, -1 = no entry). kv_scale: [B,S,ceil(R/128)] f32 for an e4m3 or int8
    `kv_latent` (dequantised block by block), else None. lse is the log-sum-exp of the scaled scores
    over the selected entries (-inf where a row selects none, whose output is 0)."""
    be = _backend.resolve(backend, interpret)
    bs = block_sizes or BlockSizes()
    bs.validate(be)
    _check_shapes(q_latent_BxHxR, q_pe_BxHxP, kv_latent_BxSxR, k_pe_BxSxP, indices_BxK, kv_scale)
    b, h, r = q_latent_BxHxR.shape
    s, p, k = kv_latent_BxSxR.shape[1], q_pe_BxHxP.shape[2], indices_BxK.shape[1]
    quantized = kv_scale is not None
    bk = bs.block_k_for(be)
    splits = bs.num_splits or max(1, min(8, -(-k // (4 * bk))))  # up to 8 splits of at least 4 blocks
    bps = -(-k // (splits * bk))
    per_split = bps * bk
    hp = _backend.next_pow2(max(h, 16)) if be.style == "triton" else round_up(h, 8)
    rp, pp = _backend.pad_feature(be, r), _backend.pad_feature(be, p)
    rp = round_up(rp, 128) if quantized else rp  # whole 128-value scale groups in a row
    idx = indices_BxK.astype(jnp.int32)
    idx = pad_axis(jnp.where((idx >= 0) & (idx < s), idx, -1), 1, splits * per_split, value=-1)
    ql = pad_axis(pad_axis(q_latent_BxHxR, 1, hp), 2, rp)
    qp = pad_axis(pad_axis(q_pe_BxHxP, 1, hp), 2, pp)
    cache = [pad_axis(kv_latent_BxSxR, 2, rp), pad_axis(k_pe_BxSxP, 2, pp)]
    if quantized:
        cache.append(pad_axis(kv_scale.astype(jnp.float32), 2, rp // 128))
    kw = dict(scale=float(softmax_scale), block_k=bk, blocks_per_split=bps, quantized=quantized)
    out_shape = [jax.ShapeDtypeStruct((b, splits, hp, rp), jnp.float32),
                 jax.ShapeDtypeStruct((b, splits, hp, 1), jnp.float32)]
    if be.style == "tpu":
        q_map = lambda bi, si, j: (bi, 0, 0)
        o_map = lambda bi, si, j: (bi, si, 0, 0)
        grid_spec = pl.GridSpec(
            grid=(b, splits, bps),
            in_specs=[pl.BlockSpec((None, None, 1, per_split), o_map, memory_space=pltpu.SMEM),
                      pl.BlockSpec((None, None, 1, bk), lambda bi, si, j: (bi, si * bps + j, 0, 0)),
                      pl.BlockSpec((None, hp, rp), q_map), pl.BlockSpec((None, hp, pp), q_map)]
                     + [pl.BlockSpec(memory_space=pl.ANY)] * len(cache),
            out_specs=[pl.BlockSpec((None, None, hp, rp), o_map), pl.BlockSpec((None, None, hp, 1), o_map)],
            scratch_shapes=[pltpu.VMEM((2, bk, a.shape[2]), a.dtype) for a in cache]
                           + [pltpu.SemaphoreType.DMA((len(cache), 2)), pltpu.VMEM((hp, 1), jnp.float32),
                              pltpu.VMEM((hp, 1), jnp.float32), pltpu.VMEM((hp, rp), jnp.float32)])
        inputs = [idx.reshape(b, splits, 1, per_split), idx.reshape(b, splits * bps, 1, bk), ql, qp, *cache]
        kernel = functools.partial(_tpu_kernel, **kw)
    else:
        bh = min(hp, bs.block_h or 16)
        q_map = lambda bi, si, hi: (bi, hi, 0)
        cache_map = lambda bi, si, hi: (bi, 0, 0)
        grid_spec = pl.GridSpec(
            grid=(b, splits, hp // bh),
            in_specs=[pl.BlockSpec((None, splits * per_split), lambda bi, si, hi: (bi, 0)),
                      pl.BlockSpec((None, bh, rp), q_map), pl.BlockSpec((None, bh, pp), q_map)]
                     + [pl.BlockSpec((None, s, a.shape[2]), cache_map) for a in cache],
            out_specs=[pl.BlockSpec((None, None, bh, rp), lambda bi, si, hi: (bi, si, hi, 0)),
                       pl.BlockSpec((None, None, bh, 1), lambda bi, si, hi: (bi, si, hi, 0))])
        inputs = [idx, ql, qp, *cache]
        kernel = functools.partial(_triton_kernel, **kw)
    o_part, lse_part = _backend.pallas_call(be, kernel, name="sparse_mla_decode", out_shape=out_shape,
                                            grid_spec=grid_spec)(*inputs)
    return _combine_splits(o_part[:, :, :h, :r], lse_part[:, :, :h, 0])


def sparse_mla_decode_reference(q_latent_BxHxR, q_pe_BxHxP, kv_latent_BxSxR, k_pe_BxSxP, indices_BxK, *,
                                softmax_scale: float, kv_scale=None, **_):
    """Plain-jnp `sparse_mla_decode`: gather the selected rows, fp32 softmax over them."""
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    s, r = kv_latent_BxSxR.shape[1:]
    valid_BxK = (indices_BxK >= 0) & (indices_BxK < s)
    rows_BxKx1 = jnp.where(valid_BxK, indices_BxK, 0)[..., None]
    kv_BxKxR = jnp.take_along_axis(kv_latent_BxSxR, rows_BxKx1, axis=1).astype(f32)
    if kv_scale is not None:
        scale_BxKxG = jnp.take_along_axis(kv_scale, rows_BxKx1, axis=1).astype(f32)
        kv_BxKxR = kv_BxKxR * jnp.repeat(scale_BxKxG, 128, axis=-1)[..., :r]
    kp_BxKxP = jnp.take_along_axis(k_pe_BxSxP, rows_BxKx1, axis=1).astype(f32)
    s_BxHxK = (jnp.einsum("bhr,bkr->bhk", q_latent_BxHxR.astype(f32), kv_BxKxR, precision=hi)
               + jnp.einsum("bhp,bkp->bhk", q_pe_BxHxP.astype(f32), kp_BxKxP, precision=hi))
    s_BxHxK = jnp.where(valid_BxK[:, None, :], s_BxHxK * softmax_scale, -jnp.inf)
    lse_BxH = jax.nn.logsumexp(s_BxHxK, axis=-1)
    p_BxHxK = jnp.where(valid_BxK[:, None, :],
                        jnp.exp(s_BxHxK - jnp.where(jnp.isfinite(lse_BxH), lse_BxH, 0)[..., None]), 0)
    return jnp.einsum("bhk,bkr->bhr", p_BxHxK, kv_BxKxR, precision=hi), lse_BxH

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
from pallas_kernels._backend import pad_axis
from pallas_kernels.mla_decode import (_dequant, _finish, _online_step, check_cache_shapes, check_splits_and_heads,
                                       head_specs, run_splits, split_layout)


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
        check_splits_and_heads(self.num_splits, self.block_h)

    def block_k_for(self, be: _backend.Backend) -> int:
        return self.block_k or (128 if be.style == "tpu" else 64)


def _row_dmas(b, idx_ref, first, slot, hbm_refs, buf_refs, sem, block_k, start: bool):
    """Starts (or waits for) the DMAs that gather rows idx_ref[0, first : first + block_k] of cache
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


def _tpu_kernel(idx_smem, idx_vmem, ql_ref, qp_ref, *refs, scale, block_k, blocks_per_split, quantized, paged):
    n = 3 if quantized else 2
    hbm, bufs = refs[:n], refs[n + 2:2 * n + 2]
    o_ref, lse_ref = refs[n:n + 2]
    sem, m_ref, l_ref, acc_ref = refs[2 * n + 2:]
    b, j = pl.program_id(0), pl.program_id(2)
    cache_row = 0 if paged else b  # a paged pool is one cache row that every query row indexes
    fetch = functools.partial(_row_dmas, cache_row, idx_smem, hbm_refs=hbm, buf_refs=bufs, sem=sem, block_k=block_k)

    @pl.when(j == 0)
    def _():
        m_ref[...], l_ref[...], acc_ref[...] = _backend.online_softmax_init(*acc_ref.shape)
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

    _finish(lax.fori_loop(0, blocks_per_split, body, _backend.online_softmax_init(*o_ref.shape)), o_ref, lse_ref)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "block_sizes", "backend", "interpret", "paged"))
def sparse_mla_decode(q_latent_BxHxR, q_pe_BxHxP, kv_latent_BxSxR, k_pe_BxSxP, indices_BxK, *,
                      softmax_scale: float, kv_scale=None, block_sizes: BlockSizes | None = None,
                      backend=None, interpret=None, paged: bool = False):
    """-> (out [B,H,R] f32, lse [B,H] f32): absorbed MLA decode over the cache rows named by
    `indices_BxK` (int32, -1 = no entry). kv_scale: [B,S,ceil(R/128)] f32 for an e4m3 or int8
    `kv_latent` (dequantised block by block), else None. lse is the log-sum-exp of the scaled scores
    over the selected entries (-inf where a row selects none, whose output is 0). `paged`: the cache
    is a pool of pages shared by the batch (kv_latent [N,K,R], k_pe [N,K,P], kv_scale [N,K,G], as
    `mla_decode`'s with a page table) and an index names the pool's slot page * K + offset."""
    be = _backend.resolve(backend, interpret)
    bs = block_sizes or BlockSizes()
    bs.validate(be)
    check_cache_shapes(q_latent_BxHxR, q_pe_BxHxP, kv_latent_BxSxR, k_pe_BxSxP, kv_scale, paged=paged)
    if paged:  # one cache row of N x K slots that every query row indexes
        kv_latent_BxSxR, k_pe_BxSxP, kv_scale = (None if a is None else a.reshape(1, -1, a.shape[-1])
                                                 for a in (kv_latent_BxSxR, k_pe_BxSxP, kv_scale))
    b, h, r = q_latent_BxHxR.shape
    if indices_BxK.ndim != 2 or indices_BxK.shape[0] != b or not jnp.issubdtype(indices_BxK.dtype, jnp.integer):
        raise ValueError(f"indices must be integer [B={b}, K], got {indices_BxK.dtype} {indices_BxK.shape}")
    s, k = kv_latent_BxSxR.shape[1], indices_BxK.shape[1]
    quantized = kv_scale is not None
    bk = bs.block_k_for(be)
    splits, bps, ql, qp = split_layout(be, q_latent_BxHxR, q_pe_BxHxP, k, bk, bs.num_splits, quantized)
    hp, rp, pp = ql.shape[1], ql.shape[2], qp.shape[2]
    per_split = bps * bk
    idx = indices_BxK.astype(jnp.int32)
    idx = pad_axis(jnp.where((idx >= 0) & (idx < s), idx, -1), 1, splits * per_split, value=-1)
    cache = [kv_latent_BxSxR, k_pe_BxSxP] + ([kv_scale.astype(jnp.float32)] if quantized else [])
    cache = [pad_axis(a, 2, w) for a, w in zip(cache, (rp, pp, rp // 128))]
    kw = dict(scale=float(softmax_scale), block_k=bk, blocks_per_split=bps, quantized=quantized)
    cache_row = (lambda bi: 0) if paged else (lambda bi: bi)
    q_specs, o_specs, head_blocks = head_specs(be, bs.block_h, ql, qp)
    if be.style == "tpu":
        grid_spec = pl.GridSpec(
            grid=(b, splits, bps),
            in_specs=[pl.BlockSpec((None, None, 1, per_split), lambda bi, si, j: (bi, si, 0, 0),
                                   memory_space=pltpu.SMEM),
                      pl.BlockSpec((None, None, 1, bk), lambda bi, si, j: (bi, si * bps + j, 0, 0))]
                     + q_specs + [pl.BlockSpec(memory_space=pl.ANY)] * len(cache),
            out_specs=o_specs,
            scratch_shapes=[pltpu.VMEM((2, bk, a.shape[2]), a.dtype) for a in cache]
                           + [pltpu.SemaphoreType.DMA((len(cache), 2)), pltpu.VMEM((hp, 1), jnp.float32),
                              pltpu.VMEM((hp, 1), jnp.float32), pltpu.VMEM((hp, rp), jnp.float32)])
        inputs = [idx.reshape(b, splits, 1, per_split), idx.reshape(b, splits * bps, 1, bk), ql, qp, *cache]
        kernel = functools.partial(_tpu_kernel, **kw, paged=paged)
    else:
        grid_spec = pl.GridSpec(
            grid=(b, splits, head_blocks),
            in_specs=[pl.BlockSpec((None, splits * per_split), lambda bi, si, hi: (bi, 0))] + q_specs
                     + [pl.BlockSpec((None, s, a.shape[2]), lambda bi, si, hi: (cache_row(bi), 0, 0)) for a in cache],
            out_specs=o_specs)
        inputs = [idx, ql, qp, *cache]
        kernel = functools.partial(_triton_kernel, **kw)
    return run_splits(be, kernel, grid_spec, inputs, name="sparse_mla_decode", ql=ql, splits=splits, h=h, r=r)


def sparse_mla_decode_reference(q_latent_BxHxR, q_pe_BxHxP, kv_latent_BxSxR, k_pe_BxSxP, indices_BxK, *,
                                softmax_scale: float, kv_scale=None, paged: bool = False, **_):
    """Plain-jnp `sparse_mla_decode`: gather the selected rows, fp32 softmax over them."""
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    if paged:  # the pool's slots, the same for every row
        kv_latent_BxSxR, k_pe_BxSxP, kv_scale = (None if a is None else jnp.broadcast_to(
            a.reshape(1, -1, a.shape[-1]), (indices_BxK.shape[0], a.shape[0] * a.shape[1], a.shape[-1]))
            for a in (kv_latent_BxSxR, k_pe_BxSxP, kv_scale))
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

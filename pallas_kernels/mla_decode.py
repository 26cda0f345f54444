"""Absorbed MLA decode over a latent KV cache, split-KV (flash-decoding) with an LSE combine.

scores[b,h,s] = (q_latent[b,h] . kv_latent[b,s] + q_pe[b,h] . k_pe[b,s]) * softmax_scale for
s < lengths[b]; out[b,h] = softmax(scores) @ kv_latent[b]. The cache axis is cut into
`num_splits` independent splits (each a partial output + LSE) so a long cache fills the chip
even at batch 1; the splits are merged by their LSEs. Blocks beyond `lengths[b]` are skipped
(TPU: their block index is clamped, so no DMA is issued either).

FP8 cache: with `kv_scale` [B,S,G] (one fp32 scale per 128 latent values, G = ceil(R/128)),
`kv_latent` is e4m3 (or int8, a per-token scale repeated over its G groups) and each block is
dequantised in VMEM/SRAM as it is read, so a step reads about half the bytes of a bf16 cache and
never writes a dequantised copy.

Paged cache: with `page_table` [B,M], the cache is a pool of pages shared by the batch,
kv_latent [N,K,R], k_pe [N,K,P], kv_scale [N,K,G], and row b's position s lives in page
page_table[b, s // K] at offset s % K. A block is one page: on TPU the page table is a scalar
prefetch operand that the cache's index map reads (pages past a row's length are clamped to its
last page, so they cost no DMA); on Triton each block is loaded by pointer from its page's offset
in the pool. Each row reads only its own pages up to its own length.

Letters: B batch, H heads, R latent rank (kv_lora), P rope dim, S cache length; paged: N pages in
the pool, K tokens per page, M page-table entries per row (S = M * K).
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


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """`block_kv` cache positions per step; `num_splits` KV splits (None: up to 8, by length);
    `block_h` heads per Triton program (None: 16). TPU programs take every head at once. All 128
    heads of the 671B in one Triton program need more shared memory than a Hopper GPU has
    (docs/benchmarks.md, Kernel choices), so the heads are cut into blocks, each its own program
    over the same cache."""

    block_kv: int = 128
    num_splits: int | None = None
    block_h: int | None = None

    def validate(self, be: _backend.Backend) -> None:
        _backend.check_blocks(be, lanes=("block_kv",), block_kv=self.block_kv)
        check_splits_and_heads(self.num_splits, self.block_h)


def check_splits_and_heads(num_splits: int | None, block_h: int | None) -> None:
    """The split-KV decode kernels' shared tunables: `num_splits` >= 1, `block_h` a power of two >= 16."""
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{num_splits=} must be >= 1")
    if block_h is not None and (block_h < 16 or block_h != _backend.next_pow2(block_h)):
        raise ValueError(f"{block_h=} must be a power of two >= 16")


def _online_step(carry, q_lat, q_pe, kv, kp, visible, scale):
    """One KV block of the online softmax over carry (m [H,1], l [H,1], acc [H,R]); `visible` [1,bk]
    says which of the block's rows count. The rope key is widened to q_pe's type (fp32 from the model):
    Triton's dot takes operands of one type."""
    s = (dot_f32(q_lat, kv, "NT") + dot_f32(q_pe, kp.astype(q_pe.dtype), "NT")) * scale
    return _backend.online_softmax_step(carry, s, visible, lambda p: _pv_dot(p, kv))


def _before(start, length, block_kv):
    """bool [1, block_kv]: which of the block's positions start .. start + block_kv lie below `length`."""
    return start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1) < length


def _pv_dot(p, v):
    """p [H,bk] f32 @ v [bk,R] in fp32 accumulate. For 16-bit v, p is split into two bf16 terms
    (hi + lo, ~16 mantissa bits) so probabilities are not rounded to bf16: 2x MXU work on a
    memory-bound kernel instead of a multi-pass fp32 matmul."""
    if v.dtype == jnp.float32:
        return dot_f32(p, v)
    p_hi = p.astype(v.dtype)
    p_lo = (p - p_hi.astype(jnp.float32)).astype(v.dtype)
    return dot_f32(p_hi, v) + dot_f32(p_lo, v)


def _finish(carry, o_ref, lse_ref):
    m, l, acc = carry
    valid = l > 0
    o_ref[...] = jnp.where(valid, acc / jnp.where(valid, l, 1.0), 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(valid, m + jnp.log(jnp.where(valid, l, 1.0)), -jnp.inf)


def _dequant(kv, sc, dtype):
    """e4m3 block [bk, G*128] times its scales [bk, G] -> `dtype`; other blocks pass through."""
    if sc is None:
        return kv
    bk, g = sc.shape
    x = kv.astype(jnp.float32).reshape(bk, g, 128) * sc[:, :, None]
    return x.reshape(kv.shape).astype(dtype)


def _tpu_kernel(len_ref, *refs, scale, block_kv, blocks_per_split, fp8, paged):
    """One (row, split, block) step; a paged cache's table (`refs[0]`) is read by the index maps only."""
    ql_ref, qp_ref, kv_ref, kp_ref, *refs = refs[1:] if paged else refs
    sc_ref, (o_ref, lse_ref, m_ref, l_ref, acc_ref) = (refs[0], refs[1:]) if fp8 else (None, refs)
    b, split, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = (split * blocks_per_split + j) * block_kv
    length = len_ref[b]

    @pl.when(j == 0)
    def _():
        m_ref[...], l_ref[...], acc_ref[...] = _backend.online_softmax_init(*acc_ref.shape)

    @pl.when(start < length)
    def _():
        kv = _dequant(kv_ref[...], None if sc_ref is None else sc_ref[...], ql_ref.dtype)
        carry = _online_step((m_ref[...], l_ref[...], acc_ref[...]), ql_ref[...], qp_ref[...],
                             kv, kp_ref[...], _before(start, length, block_kv), scale)
        m_ref[...], l_ref[...], acc_ref[...] = carry

    @pl.when(j == blocks_per_split - 1)
    def _():
        _finish((m_ref[...], l_ref[...], acc_ref[...]), o_ref, lse_ref)


def _triton_kernel(len_ref, *refs, scale, block_kv, blocks_per_split, fp8, paged):
    """One (row, split, head block): a loop over the split's blocks; `kv_ref` is the row's cache
    [S,R] or, `paged`, the whole pool [N*K,R] with the row's page table `pt_ref` [M]."""
    pt_ref, refs = (refs[0], refs[1:]) if paged else (None, refs)
    ql_ref, qp_ref, kv_ref, kp_ref, *refs = refs
    sc_ref, (o_ref, lse_ref) = (refs[0], refs[1:]) if fp8 else (None, refs)
    b, split = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]
    split_start = split * blocks_per_split * block_kv
    n_blocks = jnp.clip(pl.cdiv(length - split_start, block_kv), 0, blocks_per_split)
    q_lat, q_pe = ql_ref[...], qp_ref[...]

    def body(j, carry):
        start = pl.multiple_of(split_start + j * block_kv, block_kv)
        page = None if pt_ref is None else pt_ref[split * blocks_per_split + j]
        rows = pl.ds(start if page is None else pl.multiple_of(page * block_kv, block_kv), block_kv)
        kv = _dequant(kv_ref[rows, :], None if sc_ref is None else sc_ref[rows, :], q_lat.dtype)
        return _online_step(carry, q_lat, q_pe, kv, kp_ref[rows, :], _before(start, length, block_kv), scale)

    carry = lax.fori_loop(0, n_blocks, body, _backend.online_softmax_init(*o_ref.shape))
    _finish(carry, o_ref, lse_ref)


def check_cache_shapes(q_latent, q_pe, kv_latent, k_pe, kv_scale, paged: bool = False) -> None:
    """Raises unless q_latent [B,H,R], q_pe [B,H,P], kv_latent [B,S,R], k_pe [B,S,P] and kv_scale
    [B,S,ceil(R/128)] (or None) agree; `paged`: a pool kv_latent [N,K,R], k_pe [N,K,P], kv_scale [N,K,G]."""
    b, h, r = q_latent.shape
    n, s, p = kv_latent.shape[0], kv_latent.shape[1], q_pe.shape[2]
    rows, want = (n, "[N,K,R], [N,K,P]") if paged else (b, "[B,S,R], [B,S,P]")
    if q_pe.shape[:2] != (b, h) or kv_latent.shape != (rows, s, r) or k_pe.shape != (rows, s, p):
        raise ValueError(f"inconsistent shapes: {q_latent.shape=}, {q_pe.shape=}, "
                         f"{kv_latent.shape=}, {k_pe.shape=}; want [B,H,R], [B,H,P], {want}")
    if kv_scale is not None and kv_scale.shape != (rows, s, -(-r // 128)):
        raise ValueError(f"{kv_scale.shape=} must be ({rows}, {s}, {-(-r // 128)}): one scale per 128 latent values")


def split_layout(be: _backend.Backend, q_latent, q_pe, n: int, block: int, num_splits: int | None,
                 quantized: bool):
    """How `n` keys in blocks of `block` are cut into splits: (splits, blocks per split, the queries
    padded to the style's tiles: ql [B,Hp,Rp], qp [B,Hp,Pp], Rp whole 128-value scale groups for a
    quantised cache)."""
    (h, r), p = q_latent.shape[1:], q_pe.shape[2]
    splits = num_splits or max(1, min(8, -(-n // (4 * block))))  # up to 8 splits of at least 4 blocks
    hp = _backend.next_pow2(max(h, 16)) if be.style == "triton" else round_up(h, 8)
    rp, pp = _backend.pad_feature(be, r), _backend.pad_feature(be, p)
    rp = round_up(rp, 128) if quantized else rp
    ql = pad_axis(pad_axis(q_latent, 1, hp), 2, rp)
    qp = pad_axis(pad_axis(q_pe, 1, hp), 2, pp)
    return splits, -(-n // (splits * block)), ql, qp


def head_specs(be: _backend.Backend, block_h: int | None, ql, qp):
    """BlockSpecs of the queries and of the per-split (out, lse) on a grid (B, splits, x): a TPU program
    takes every head; a Triton program `block_h` of them (None: 16), x being its head block.
    Returns (query specs, output specs, head blocks)."""
    hp, rp, pp = ql.shape[1], ql.shape[2], qp.shape[2]
    tpu = be.style == "tpu"
    bh = hp if tpu else min(hp, block_h or 16)

    def q_map(bi, si, x, *prefetch):  # x: the grid's last axis, a key block on TPU, a head block on Triton
        return bi, 0 if tpu else x, 0

    def o_map(bi, si, x, *prefetch):
        return bi, si, 0 if tpu else x, 0

    return ([pl.BlockSpec((None, bh, rp), q_map), pl.BlockSpec((None, bh, pp), q_map)],
            [pl.BlockSpec((None, None, bh, rp), o_map), pl.BlockSpec((None, None, bh, 1), o_map)], hp // bh)


def run_splits(be: _backend.Backend, kernel, grid_spec, inputs, *, name: str, ql, splits: int, h: int, r: int):
    """The kernel's per-split (out, lse) for queries padded to `ql` [B,Hp,Rp], merged by their LSEs:
    rows with no positions give 0, -inf. -> (out [B,H,R] f32, lse [B,H] f32)."""
    b, hp, rp = ql.shape
    out_shape = [jax.ShapeDtypeStruct((b, splits, hp, rp), jnp.float32),
                 jax.ShapeDtypeStruct((b, splits, hp, 1), jnp.float32)]
    o_part, lse_part = _backend.pallas_call(be, kernel, name=name, out_shape=out_shape, grid_spec=grid_spec)(*inputs)
    o_BxSPxHxR, lse_BxSPxH = o_part[:, :, :h, :r], lse_part[:, :, :h, 0]
    m = jnp.max(lse_BxSPxH, axis=1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_BxSPxH - m)
    denom = jnp.sum(w, axis=1)
    out = jnp.einsum("bsh,bshr->bhr", w, o_BxSPxHxR) / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out, m[:, 0] + jnp.log(denom)


def _cache_specs(be: _backend.Backend, cache, *, block_kv: int, splits: int, blocks_per_split: int,
                 paged: bool):
    """BlockSpecs of the cache operands (a row's [B,S,X] or the flat pool [N*K,X]). TPU: one block per
    step, clamped to the row's last needed block (skipped blocks cost no DMA), paged: at the page the
    flat table names. Triton: the row's whole cache, or the whole pool, read block by block in the loop."""
    if be.style == "tpu":
        def kv_map(bi, si, j, len_ref, *table_ref):
            block = jnp.minimum(si * blocks_per_split + j, jnp.maximum(pl.cdiv(len_ref[bi], block_kv) - 1, 0))
            return (table_ref[0][bi * splits * blocks_per_split + block], 0) if paged else (bi, block, 0)
        return [pl.BlockSpec((block_kv, a.shape[-1]) if paged else (None, block_kv, a.shape[-1]), kv_map)
                for a in cache]
    if paged:
        return [pl.BlockSpec(a.shape, lambda bi, si, hi: (0, 0)) for a in cache]
    return [pl.BlockSpec((None,) + a.shape[1:], lambda bi, si, hi: (bi, 0, 0)) for a in cache]


@functools.partial(jax.jit, static_argnames=("softmax_scale", "return_lse", "block_sizes",
                                             "backend", "interpret"))
def mla_decode(q_latent, q_pe, kv_latent, k_pe, lengths, *, softmax_scale: float,
               return_lse: bool = False, block_sizes: BlockSizes | None = None,
               backend=None, interpret=None, kv_scale=None, page_table=None):
    """q_latent [B,H,R], q_pe [B,H,P], kv_latent [B,S,R], k_pe [B,S,P], lengths [B] -> [B,H,R] f32.

    kv_scale: [B,S,ceil(R/128)] f32 for an e4m3 or int8 `kv_latent` (dequantised block by block), else None.
    page_table: int [B,M] for a paged cache (kv_latent [N,K,R], k_pe [N,K,P], kv_scale [N,K,G]; a
    block is one page, so `block_sizes.block_kv` is unused), else None. Entries after the page that
    holds a row's last position are never used and may hold anything (-1 for no page, say).

    With `return_lse` also returns the log-sum-exp of the scaled scores, [B,H] f32
    (-inf where lengths[b] == 0, whose output row is 0).
    """
    be = _backend.resolve(backend, interpret)
    bs = block_sizes or BlockSizes()
    bs.validate(be)
    paged = page_table is not None
    check_cache_shapes(q_latent, q_pe, kv_latent, k_pe, kv_scale, paged)
    b, h, r = q_latent.shape
    if lengths.shape != (b,):
        raise ValueError(f"{lengths.shape=} must be ({b},)")
    if paged and (page_table.ndim != 2 or page_table.shape[0] != b
                  or not jnp.issubdtype(page_table.dtype, jnp.integer)):
        raise ValueError(f"page_table must be integer [B={b}, M], got {page_table.dtype} {page_table.shape}")
    bk = kv_latent.shape[1] if paged else bs.block_kv
    if paged:
        _backend.check_blocks(be, lanes=("page_size",), page_size=bk)
    s = page_table.shape[1] * bk if paged else kv_latent.shape[1]
    fp8 = kv_scale is not None
    splits, bps, ql, qp = split_layout(be, q_latent, q_pe, s, bk, bs.num_splits, fp8)
    hp, rp, pp = ql.shape[1], ql.shape[2], qp.shape[2]
    cache = [kv_latent, k_pe] + ([kv_scale.astype(jnp.float32)] if fp8 else [])
    cache = [pad_axis(a, 2, w) for a, w in zip(cache, (rp, pp, rp // 128))]
    meta = [jnp.clip(lengths.astype(jnp.int32), 0, s)]
    if paged:  # the pool as rows [N*K, X]; ids clipped into it: an empty row's TPU blocks still name entry 0
        cache = [a.reshape(-1, a.shape[2]) for a in cache]
        meta.append(pad_axis(jnp.clip(page_table.astype(jnp.int32), 0, kv_latent.shape[0] - 1), 1, splits * bps))
    else:
        cache = [pad_axis(a, 1, splits * bps * bk) for a in cache]
    q_specs, o_specs, head_blocks = head_specs(be, bs.block_h, ql, qp)
    kv_specs = _cache_specs(be, cache, block_kv=bk, splits=splits, blocks_per_split=bps, paged=paged)
    if be.style == "tpu":
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(meta), grid=(b, splits, bps), in_specs=q_specs + kv_specs, out_specs=o_specs,
            scratch_shapes=[pltpu.VMEM((hp, 1), jnp.float32), pltpu.VMEM((hp, 1), jnp.float32),
                            pltpu.VMEM((hp, rp), jnp.float32)])
        meta[1:] = [table.reshape(-1) for table in meta[1:]]  # flat in SMEM, as jax's TPU paged attention
        kernel = _tpu_kernel
    else:
        meta_specs = [pl.BlockSpec((b,), lambda bi, si, hi: (0,)),
                      pl.BlockSpec((None, splits * bps), lambda bi, si, hi: (bi, 0))][:len(meta)]
        grid_spec = pl.GridSpec(grid=(b, splits, head_blocks), in_specs=meta_specs + q_specs + kv_specs,
                                out_specs=o_specs)
        kernel = _triton_kernel
    kernel = functools.partial(kernel, scale=float(softmax_scale), block_kv=bk, blocks_per_split=bps, fp8=fp8,
                               paged=paged)
    out, lse = run_splits(be, kernel, grid_spec, meta + [ql, qp] + cache, name="mla_decode", ql=ql,
                          splits=splits, h=h, r=r)
    return (out, lse) if return_lse else out


def mla_decode_reference(q_latent, q_pe, kv_latent, k_pe, lengths, *, softmax_scale: float,
                         return_lse: bool = False, kv_scale=None, page_table=None, **_):
    """Plain-jnp `mla_decode` (fp32, full precision, whole-cache softmax); a paged cache's pages are
    first gathered into each row's contiguous cache [B,M*K,X]."""
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    if page_table is not None:
        pages_BxM = jnp.clip(page_table, 0, kv_latent.shape[0] - 1)
        gather = lambda a: None if a is None else a[pages_BxM].reshape(pages_BxM.shape[0], -1, a.shape[2])
        kv_latent, k_pe, kv_scale = gather(kv_latent), gather(k_pe), gather(kv_scale)
    if kv_scale is not None:
        r = kv_latent.shape[-1]
        kv_latent = kv_latent.astype(f32) * jnp.repeat(kv_scale.astype(f32), 128, axis=-1)[..., :r]
    s_BxHxS = (jnp.einsum("bhr,bsr->bhs", q_latent.astype(f32), kv_latent.astype(f32), precision=hi)
               + jnp.einsum("bhp,bsp->bhs", q_pe.astype(f32), k_pe.astype(f32), precision=hi))
    s_BxHxS = s_BxHxS * softmax_scale
    valid = jnp.arange(kv_latent.shape[1])[None, None, :] < lengths[:, None, None]
    s_BxHxS = jnp.where(valid, s_BxHxS, -jnp.inf)
    lse_BxH = jax.nn.logsumexp(s_BxHxS, axis=-1)
    p = jnp.where(valid, jnp.exp(s_BxHxS - jnp.where(jnp.isfinite(lse_BxH), lse_BxH, 0)[..., None]), 0)
    out = jnp.einsum("bhs,bsr->bhr", p, kv_latent.astype(f32), precision=hi)
    return (out, lse_BxH) if return_lse else out

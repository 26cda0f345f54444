"""Attention in MLA's latent space over the latent cache: the core of the absorbed form.

Letters: B batch, W queries of this call, S cache slots, H heads, C latent (kv_lora_rank),
R rope dim, G latent scales per token (ceil(C / 128) for fp8, 1 for int8), P slots per block read;
a paged cache: N pages in the pool, K slots per page, M page-table entries per row, J pages per
work item (one row's, consecutive), T work items per step.

A call's W tokens sit at consecutive positions p0 .. p0 + W - 1 (slot s of the cache holds the
token at position s). They attend to the cache slots s < p0 and to their own fresh entries up to
their position, so the cache never needs clearing: slots from p0 on are never read. The cache is
read block by block (P slots at a time) with an online softmax: an fp8 block is dequantised as it
is read, so neither the whole cache in the compute dtype nor [B, H, W, S] scores ever exist, and
blocks past every row's p0 are not read at all. A paged cache (`attend`'s page_table) is read as
the list of (row, page) pairs the rows use, so rows of different lengths cost their own lengths.

`attend` is the core of the absorbed form (decode, speculative verify: few queries, so the
queries move into the latent space once). `attend_expanded` is the expanded (naive) form for a
prompt chunk (DeepSeek's prefill): the cached prefix's latent is expanded to per-head keys and
values block by block, only the blocks before the chunk, with a flash-style online softmax; the
caller merges it with the chunk's own causal attention by log-sum-exp (`merge`).

Cache dtypes: float32 / bfloat16 entries as they are; "float8": e4m3 latent with one fp32 scale
per 128 values (DeepSeek's 1x128 activation recipe) and a bf16 rope key (the FlashMLA layout);
"int8": symmetric int8 latent with one fp32 scale per token (amax / 127, round to nearest) and a
bf16 rope key. The latent's dtype says which scale layout a cache carries.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import quantize_1x128
from dsv3_jax.ops.quant import E4M3_MAX

FP8_BLOCK = 128  # latent values per fp8 scale
INT8_MAX = 127.0  # symmetric int8: -127 .. 127, so 0 is exact and the range is even
READ_BLOCK = 256  # cache slots per block read


def encode(latent_BxWxC: jax.Array, k_pe_BxWxR: jax.Array, cache_dtype: str):
    """Fresh entries -> (latent, latent_scale | None, k_pe) in the cache's dtypes."""
    if cache_dtype == "int8":
        return (*quantize_per_token(latent_BxWxC), k_pe_BxWxR.astype(jnp.bfloat16))
    if cache_dtype != "float8":
        dt = jnp.dtype(cache_dtype)
        return latent_BxWxC.astype(dt), None, k_pe_BxWxR.astype(dt)
    b, w, c = latent_BxWxC.shape
    q, scale = quantize_1x128(latent_BxWxC.reshape(b * w, c).astype(jnp.float32))
    return q.reshape(b, w, c), scale.reshape(b, w, -1), k_pe_BxWxR.astype(jnp.bfloat16)


def quantize_per_token(x_BxWxX: jax.Array, dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """-> (q [B, W, X] in `dtype`, fp32 scale [B, W, 1]): x ~= q * scale, scale = amax(|x|) / qmax per
    token; int8: qmax 127, rounded to nearest; e4m3: qmax 448."""
    x = x_BxWxX.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    qmax = INT8_MAX if dtype == jnp.int8 else E4M3_MAX
    scale = jnp.where(amax > 0, amax / qmax, 1.0)  # an all-zero token keeps zeros, not NaNs
    if dtype == jnp.int8:
        return jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale
    return (x / scale).astype(dtype), scale


def dequantize(latent_BxSxC: jax.Array, scale_BxSxG: jax.Array | None, dtype) -> jax.Array:
    """Cached latent -> `dtype` values (int8 entries times their token's scale, fp8 entries times
    their per-128 scale)."""
    if scale_BxSxG is None:
        return latent_BxSxC.astype(dtype)
    c = latent_BxSxC.shape[-1]
    block = c if latent_BxSxC.dtype == jnp.int8 else FP8_BLOCK
    scale = jnp.repeat(scale_BxSxG, block, axis=-1)[..., :c]
    return (latent_BxSxC.astype(jnp.float32) * scale).astype(dtype)


def _softmax_step(carry, s_BxHxWxP, values, eq: str, dt):
    """One block of P keys of the online softmax: carry = (max [B,H,W], sum [B,H,W], acc [B,H,W,*]),
    scores already scaled and masked (-inf), `values` contracted with the probabilities by `eq`."""
    m_prev, l_prev, acc_prev = carry
    m_new = jnp.maximum(m_prev, jnp.max(s_BxHxWxP, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # nothing visible yet: everything stays 0
    alpha, p = jnp.exp(m_prev - m_safe), jnp.exp(s_BxHxWxP - m_safe[..., None])
    pv = jnp.einsum(eq, p.astype(dt), values.astype(dt), preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + jnp.sum(p, axis=-1), alpha[..., None] * acc_prev + pv


def _block_step(carry, q_lat, q_pe, latent_BxPxC, k_pe_BxPxR, visible_Bx1xWxP, softmax_scale, dt):
    """One block of P latent keys, queries heads-first [B, H, W, *]. Heads-first, each block's two
    dots are plain batched matmuls ([H*W, C] x [C, P] and [H*W, P] x [P, C]); with acc as
    [B, W, H, C], XLA:CPU ran the second as a transposed dot outside its fast matmul path
    (docs/benchmarks.md, Kernel choices)."""
    s = (jnp.einsum("BHWC,BPC->BHWP", q_lat, latent_BxPxC.astype(dt), preferred_element_type=jnp.float32)
         + jnp.einsum("BHWR,BPR->BHWP", q_pe, k_pe_BxPxR.astype(dt), preferred_element_type=jnp.float32))
    s = jnp.where(visible_Bx1xWxP, s * softmax_scale, -jnp.inf)
    return _softmax_step(carry, s, latent_BxPxC, "BHWP,BPC->BHWC", dt)


def _own_mask(positions_BxW: jax.Array) -> jax.Array:
    """bool [B, 1, W, W]: a call's token sees its own entries up to its position."""
    return positions_BxW[:, None, None, :] <= positions_BxW[:, None, :, None]


def _reader(cache, layer, block: int):
    """read(a, start) -> slots start .. start + block of one layer: of [B, S, ...] arrays, or of a
    stack [L, B, S, ...] at `layer` (sliced per block, so the layer is never copied whole)."""
    def read(a, start):
        if a is None:
            return None
        if layer is None:
            return jax.lax.dynamic_slice_in_dim(a, start, block, axis=1)
        index = (layer, 0, start) + (0,) * (a.ndim - 3)
        return jax.lax.dynamic_slice(a, index, (1, a.shape[1], block, *a.shape[3:]))[0]
    return read


def _empty(acc_shape):
    """The online softmax before any key: (max -inf, sum 0, acc 0), acc_shape [B, H, W, *]."""
    return (jnp.full(acc_shape[:3], -jnp.inf, jnp.float32), jnp.zeros(acc_shape[:3], jnp.float32),
            jnp.zeros(acc_shape, jnp.float32))


def _over_cache(step, acc_shape, cache, positions_BxW, layer, block: int, dt, page_table=None):
    """The online softmax (`step(carry, latent [B, P, C] dequantised to dt, k_pe [B, P, R],
    visible [B, P])`) over the cache slots before each row's first position, `block` slots at a
    time; blocks past every row's start are never read. Starts empty; acc_shape [B, H, W, *].
    With `page_table`, of a pool of pages (`_over_pages`)."""
    if page_table is not None:
        return _over_pages(step, acc_shape, cache, page_table, positions_BxW[:, 0], layer, block, dt)
    latent_BxSxC, scale_BxSxG, k_pe_BxSxR = cache[:3]
    block = math.gcd(block, latent_BxSxC.shape[-2])  # blocks tile the cache exactly
    read = _reader(cache, layer, block)
    before_B = positions_BxW[:, 0]
    init = _empty(acc_shape)

    def body(i, carry):
        start = i * block
        visible_BxP = (start + jnp.arange(block))[None, :] < before_B[:, None]
        latent_BxPxC = dequantize(read(latent_BxSxC, start), read(scale_BxSxG, start), dt)
        return step(carry, latent_BxPxC, read(k_pe_BxSxR, start), visible_BxP)

    num_blocks = (jnp.max(before_B) + block - 1) // block
    return jax.lax.fori_loop(0, num_blocks, body, init)


def _fold(carry_BxHxW, part_TxHxW, rows_T):
    """Work items' partial softmaxes (max, sum, acc, each over its own keys) folded into their rows'
    by log-sum-exp; items of row B (padding) are dropped."""
    (m_B, l_B, acc_B), (m_T, l_T, acc_T) = carry_BxHxW, part_TxHxW
    b = m_B.shape[0]
    m_new = jnp.maximum(m_B, jax.ops.segment_max(m_T, rows_T, b, indices_are_sorted=True))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with nothing visible yet stays 0
    alpha_B, beta_T = jnp.exp(m_B - m_safe), jnp.exp(m_T - m_safe[jnp.minimum(rows_T, b - 1)])
    l_B = alpha_B * l_B + jax.ops.segment_sum(beta_T * l_T, rows_T, b, indices_are_sorted=True)
    acc_T = beta_T[..., None] * acc_T
    return m_new, l_B, alpha_B[..., None] * acc_B + jax.ops.segment_sum(acc_T, rows_T, b, indices_are_sorted=True)


def _page_items(page_table_BxM: jax.Array, before_B: jax.Array, page_size: int, block: int):
    """A paged read's work items: J consecutive pages of one row (J * K about `block` slots, at most
    the table's M), the items of each row's slots before `before_B` in row order (none for a row
    with no page: another shard's), B of them per step, the last step padded with items of row B
    -> (steps, P = J * K, item(i) -> (rows_T (B: padding), row_T (clamped to a row), first slot_T,
    page_TxJ) of step i)."""
    b, m = page_table_BxM.shape
    per_item = max(1, min(block // page_size, m))
    p = per_item * page_size
    items_B = jnp.where(page_table_BxM[:, 0] >= 0, (before_B + p - 1) // p, 0)
    ends_B = jnp.cumsum(items_B)

    def item(i):
        t_T = i * b + jnp.arange(b)
        rows_T = jnp.searchsorted(ends_B, t_T, side="right")  # B: past the last item
        row_T = jnp.minimum(rows_T, b - 1)
        j_T = t_T - ends_B[row_T] + items_B[row_T]  # the item's index among its row's
        entry_TxJ = jnp.minimum(j_T[:, None] * per_item + jnp.arange(per_item), m - 1)  # in the row's table
        return rows_T, row_T, j_T * p, page_table_BxM[row_T[:, None], entry_TxJ]

    return (ends_B[-1] + b - 1) // b, p, item


def _read_pages(a: jax.Array | None, layer, page_TxJ: jax.Array, p: int) -> jax.Array | None:
    """Pages [T, J] of a pool [(L,) N, K, X] (at `layer`) as [T, P = J * K, X]."""
    if a is None:
        return None
    a_TxJxKxX = a[page_TxJ] if layer is None else a[layer, page_TxJ]
    return a_TxJxKxX.reshape(page_TxJ.shape[0], p, a.shape[-1])


def _over_pages(step, acc_shape, pages, page_table_BxM, before_B, layer, block: int, dt):
    """`_over_cache`'s online softmax over each row's slots before `before_B`, read from a pool of
    pages in `_page_items`' work items, each a partial softmax over its P = J * K slots
    (`step(empty, latent [T, P, C], k_pe [T, P, R], visible [T, P], rows [T])`, the queries of rows
    T) folded into its row's; steps past the last item are never run. An item of several pages keeps
    a step's dots as wide as the contiguous path's blocks and folds once per J pages."""
    b, (latent, scale, k_pe) = acc_shape[0], pages[:3]
    if page_table_BxM.ndim != 2 or page_table_BxM.shape[0] != b:
        raise ValueError(f"page_table must be [B={b}, M], got {page_table_BxM.shape}")
    steps, p, item = _page_items(page_table_BxM, before_B, latent.shape[-2], block)
    empty = _empty(acc_shape)  # a step's T = B items start from it as the rows do

    def body(i, carry):
        rows_T, row_T, start_T, page_TxJ = item(i)
        visible_TxP = start_T[:, None] + jnp.arange(p) < before_B[row_T, None]
        latent_TxPxC = dequantize(_read_pages(latent, layer, page_TxJ, p), _read_pages(scale, layer, page_TxJ, p), dt)
        return _fold(carry, step(empty, latent_TxPxC, _read_pages(k_pe, layer, page_TxJ, p), visible_TxP, row_T),
                     rows_T)

    return jax.lax.fori_loop(0, steps, body, empty)


def scores_over_pages(score, keys, scale, page_table_BxM: jax.Array, before_B: jax.Array, width: int, *, layer=None,
                      block: int = READ_BLOCK) -> jax.Array:
    """Per-slot scores float32 [B, W, S = M x K] of each row's slots before `before_B`, its keys
    [(L,) N, K, X] (and their scales [(L,) N, K, 1] | None) read from a pool of pages through the
    table in `_page_items`' work items: `score(keys [T, P, X], scale [T, P, 1] | None, row_T, first
    slot_T)` -> [T, W, P]. So the cost follows the sum of the rows' prefixes; slots not read (past a
    row's prefix, of a row with no page here) score 0."""
    b, m = page_table_BxM.shape
    steps, p, item = _page_items(page_table_BxM, before_B, keys.shape[-2], block)

    def body(i, out_BxWxS):
        rows_T, row_T, start_T, page_TxJ = item(i)
        part_TxWxP = score(_read_pages(keys, layer, page_TxJ, p), _read_pages(scale, layer, page_TxJ, p), row_T,
                           start_T)
        slot_Tx1xP = (start_T[:, None] + jnp.arange(p))[:, None, :]  # past the table (clamped pages): dropped
        return out_BxWxS.at[rows_T[:, None, None], jnp.arange(width)[:, None], slot_Tx1xP].set(part_TxWxP,
                                                                                             mode="drop")

    return jax.lax.fori_loop(0, steps, body, jnp.zeros((b, width, m * keys.shape[-2]), jnp.float32))


def attend(q_lat_BxWxHxC, q_pe_BxWxHxR, cache, own, positions_BxW, *, softmax_scale: float, compute_dtype,
           block: int = READ_BLOCK, layer=None, page_table=None) -> jax.Array:
    """Softmax over the cache slots before each row's first position (read `block` slots at a time)
    and over the call's own entries up to each query -> o_lat [B, W, H, C] float32.

    cache = (latent [B, S, C], latent_scale [B, S, G] | None, k_pe [B, S, R]) in the cache's dtypes,
    or the same with a leading layer axis [L, ...] and the `layer` (maybe traced) to read;
    own = (latent [B, W, C], k_pe [B, W, R]) as computed (not rounded to the cache dtype: as in
    FlashMLA, a token's own step attends to exact entries, later steps read the stored ones).
    q_pe is already rotated; positions are consecutive per row.

    page_table int [B, M]: the XLA path of a paged latent cache (beside `pallas_kernels.mla_decode`'s
    paged form). `cache` is then a pool of pages shared by the batch, (latent [N, K, C],
    latent_scale [N, K, G] | None, k_pe [N, K, R]) or stacked [L, N, K, ...], and row b's slot s
    lives in page page_table[b, s // K] at offset s % K; entries past a row's prefix
    (positions[b, 0] <= M * K) are never used and may hold anything. Only the pages the rows use are
    read, B work items of about `block` slots (whole pages) a step, so the cost grows with the sum
    of the rows' prefixes, not B x the longest.
    """
    dt = compute_dtype
    q_lat, q_pe = (jnp.transpose(q.astype(dt), (0, 2, 1, 3)) for q in (q_lat_BxWxHxC, q_pe_BxWxHxR))

    def step(carry, latent_BxPxC, k_pe_BxPxR, visible_BxP, rows=slice(None)):
        visible_Bx1x1xP = visible_BxP[:, None, None, :]
        return _block_step(carry, q_lat[rows], q_pe[rows], latent_BxPxC, k_pe_BxPxR, visible_Bx1x1xP, softmax_scale,
                           dt)

    carry = _over_cache(step, q_lat.shape, cache, positions_BxW, layer, block, dt, page_table)
    _, l_sum, acc = _block_step(carry, q_lat, q_pe, *own, _own_mask(positions_BxW), softmax_scale, dt)
    return jnp.transpose(acc / l_sum[..., None], (0, 2, 1, 3))


def attend_expanded(q_nope_BxWxHxN, q_pe_BxWxHxR, w_uk_CxHxN, w_uv_CxHxV, cache, positions_BxW, *,
                    softmax_scale: float, compute_dtype, block: int = READ_BLOCK, layer=None, page_table=None
                    ) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of a chunk's queries over the cache slots before each row's first position,
    keys and values expanded per head from the cached latent a block of `block` slots at a time
    (blocks past every row's start are never read nor expanded) -> (out [B, W, H, V] float32,
    lse [B, W, H] float32; -inf where a row has no prefix). `cache`, `layer` and `page_table` as in
    `attend`."""
    dt = compute_dtype
    q_nope = jnp.transpose(q_nope_BxWxHxN, (0, 2, 1, 3)).astype(dt)
    q_pe = jnp.transpose(q_pe_BxWxHxR, (0, 2, 1, 3)).astype(dt)
    w_uk, w_uv = w_uk_CxHxN.astype(dt), w_uv_CxHxV.astype(dt)

    def step(carry, latent_BxPxC, k_pe_BxPxR, visible_BxP, rows=slice(None)):
        """One block of P cached slots, expanded to per-head keys [B, H, P, N] and values [B, H, P, V]."""
        bias = jnp.where(visible_BxP, 0.0, -jnp.inf)[:, None, None, :]
        k_nope = jnp.einsum("BPC,CHN->BHPN", latent_BxPxC.astype(dt), w_uk, preferred_element_type=jnp.float32)
        v = jnp.einsum("BPC,CHV->BHPV", latent_BxPxC.astype(dt), w_uv, preferred_element_type=jnp.float32)
        s = (jnp.einsum("BHWN,BHPN->BHWP", q_nope[rows], k_nope.astype(dt), preferred_element_type=jnp.float32)
             + jnp.einsum("BHWR,BPR->BHWP", q_pe[rows], k_pe_BxPxR.astype(dt), preferred_element_type=jnp.float32))
        return _softmax_step(carry, s * softmax_scale + bias, v, "BHWP,BHPV->BHWV", dt)

    acc_shape = q_nope.shape[:3] + (w_uv.shape[-1],)
    m, l_sum, acc = _over_cache(step, acc_shape, cache, positions_BxW, layer, block, dt, page_table)
    lse = jnp.where(l_sum > 0, m + jnp.log(jnp.where(l_sum > 0, l_sum, 1.0)), -jnp.inf)
    out = acc / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]
    return jnp.transpose(out, (0, 2, 1, 3)), jnp.transpose(lse, (0, 2, 1))


def merge(out_a_BxWxHxV, lse_a_BxWxH, out_b_BxWxHxV, lse_b_BxWxH) -> jax.Array:
    """Softmax attention over the union of two disjoint key sets from each one's normalised output
    and log-normaliser (one of them finite per query) -> [B, W, H, V] float32."""
    m = jnp.maximum(lse_a_BxWxH, lse_b_BxWxH)
    w_a, w_b = jnp.exp(lse_a_BxWxH - m), jnp.exp(lse_b_BxWxH - m)
    out = w_a[..., None] * out_a_BxWxHxV.astype(jnp.float32) + w_b[..., None] * out_b_BxWxHxV.astype(jnp.float32)
    return out / (w_a + w_b)[..., None]


def _decode_operands(q_lat_BxWxHxC, q_pe_BxWxHxR, cache, layer, dt):
    """What a Pallas decode kernel takes for one query per row: (q_lat [B, H, C] in dt, q_pe [B, H, R]
    fp32, latent [B, S, C] (8-bit as stored, else in dt), k_pe [B, S, R] in dt, the latent's scales
    as one per 128 values or None) of one layer (a stack is sliced at `layer` first)."""
    latent_BxSxC, scale_BxSxG, k_pe_BxSxR = (layer_slice(a, layer) for a in cache[:3])
    q_lat, q_pe = q_lat_BxWxHxC[:, 0].astype(dt), q_pe_BxWxHxR[:, 0].astype(jnp.float32)
    if scale_BxSxG is None:
        return q_lat, q_pe, latent_BxSxC.astype(dt), k_pe_BxSxR.astype(dt), None
    if latent_BxSxC.dtype == jnp.int8:  # an int8 token's one scale repeated over its ceil(C / 128) blocks
        blocks = -(-latent_BxSxC.shape[-1] // FP8_BLOCK)
        scale_BxSxG = jnp.broadcast_to(scale_BxSxG, (*scale_BxSxG.shape[:-1], blocks))
    return q_lat, q_pe, latent_BxSxC, k_pe_BxSxR.astype(dt), scale_BxSxG


def attend_pallas(q_lat_BxWxHxC, q_pe_BxWxHxR, cache, own, positions_BxW, *, softmax_scale: float,
                  compute_dtype, layer=None, page_table=None) -> jax.Array:
    """`attend` for one query per row: the split-KV Pallas decode kernel over the cache (or, with
    `page_table`, its pool of pages), merged with the token's own entry by log-sum-exp
    -> [B, 1, H, C] float32."""
    q_lat, q_pe, latent, k_pe, scale = _decode_operands(q_lat_BxWxHxC, q_pe_BxWxHxR, cache, layer, compute_dtype)
    o_BxHxC, lse_BxH = pallas_kernels.mla_decode(q_lat, q_pe, latent, k_pe, positions_BxW[:, 0],
                                                 softmax_scale=softmax_scale, return_lse=True, kv_scale=scale,
                                                 page_table=page_table)
    return _merge_own(o_BxHxC, lse_BxH, q_lat, q_pe, own, None, softmax_scale, compute_dtype)


def _merge_own(o_BxHxC, lse_BxH, q_lat_BxHxC, q_pe_BxHxR, own, own_kept_B, softmax_scale: float, dt) -> jax.Array:
    """A decode kernel's (out, lse) over cache rows merged by log-sum-exp with the token's own entry
    (where `own_kept` [B]; None: everywhere) -> [B, 1, H, C] float32."""
    own_latent, own_k_pe = own[0][:, 0].astype(dt), own[1][:, 0].astype(dt)
    s_own_BxH = (jnp.einsum("BHC,BC->BH", q_lat_BxHxC, own_latent, preferred_element_type=jnp.float32)
                 + jnp.einsum("BHR,BR->BH", q_pe_BxHxR.astype(dt), own_k_pe, preferred_element_type=jnp.float32))
    s_own_BxH = s_own_BxH * softmax_scale
    if own_kept_B is not None:
        s_own_BxH = jnp.where(own_kept_B[:, None], s_own_BxH, -jnp.inf)
    return merge(o_BxHxC[:, None], lse_BxH[:, None], own_latent[:, None, None, :], s_own_BxH[:, None])


def layer_slice(a: jax.Array | None, layer) -> jax.Array | None:
    """One layer [B, S, ...] of a stacked cache array [L, B, S, ...] (`layer` None: `a` is one layer)."""
    return a if a is None or layer is None else a[layer]


def encode_index_key(k_BxWxK: jax.Array, cache_dtype: str) -> tuple[jax.Array, jax.Array | None]:
    """Fresh index keys -> (key, scale [B, W, 1] | None) in the cache's dtypes: float32 / bfloat16 as
    they are, int8 and e4m3 with one fp32 scale per key (amax / 127, amax / 448)."""
    if cache_dtype in ("int8", "float8"):
        return quantize_per_token(k_BxWxK, jnp.int8 if cache_dtype == "int8" else jnp.float8_e4m3fn)
    return k_BxWxK.astype(cache_dtype), None


def cache_index(slots_BxX: jax.Array, page_table_BxM: jax.Array | None = None, pool_NxK: tuple[int, int] = (0, 0)):
    """Where each row's `slots` [B, ...] live in a cache array's (row, slot) axes: (b, s) in a
    contiguous cache; with a `page_table`, (page_table[b, s // K], s % K) in a pool of N pages of K
    slots (`pool_NxK`), a slot with no page (-1, or past the table) at page N, out of bounds: a
    scatter drops it, `gather_slots` reads zeros."""
    b = slots_BxX.shape[0]
    if page_table_BxM is None:
        return jnp.arange(b).reshape((b,) + (1,) * (slots_BxX.ndim - 1)), slots_BxX
    n, k = pool_NxK
    entry_BxX = (slots_BxX // k).reshape(b, -1)
    page = jnp.take_along_axis(page_table_BxM, entry_BxX, axis=1, mode="fill", fill_value=-1).reshape(slots_BxX.shape)
    return jnp.where(page < 0, n, page), slots_BxX % k


def gather_slots(a: jax.Array | None, layer, slots_BxX: jax.Array, page_table=None) -> jax.Array | None:
    """Entries a[(layer,) b, slots[b, ...]] -> [B, ..., *] of a cache array [(L,) B, S, *], or
    with a `page_table` of a pool [(L,) N, K, *]: one gather from the stack, no layer copy. A slot
    past the cache or with no page (-1: none, or on a mesh another shard's) reads zeros."""
    if a is None:
        return None
    index = cache_index(slots_BxX, page_table, a.shape[-3:-1])
    return a.at[index if layer is None else (layer, *index)].get(mode="fill", fill_value=0)


def row_slots(a: jax.Array, page_table_BxM: jax.Array | None = None) -> int:
    """Slots a row addresses: S of a cache array [(L,) B, S, *], M x K through a page table."""
    return a.shape[-2] if page_table_BxM is None else page_table_BxM.shape[1] * a.shape[-2]


def read_chosen(cache, layer, chosen_BxWxK: jax.Array, compute_dtype, page_table=None):
    """The cache entries a sparse call chose (`chosen` as in `attend_sparse`) -> (latent [B, W, K, C]
    dequantised, k_pe [B, W, K, R]) in compute_dtype, zero where the choice is no cache slot (the
    call's own entry, none) or its page is not here."""
    latent, scale, k_pe = cache[:3]
    s = row_slots(latent, page_table)
    slots = jnp.where((chosen_BxWxK >= 0) & (chosen_BxWxK < s), chosen_BxWxK, s)  # s: past the cache, zeros
    read = functools.partial(gather_slots, layer=layer, slots_BxX=slots, page_table=page_table)
    return dequantize(read(latent), read(scale), compute_dtype), read(k_pe).astype(compute_dtype)


def attend_sparse(q_lat_BxWxHxC, q_pe_BxWxHxR, chosen_rows, own, chosen_BxWxK, slots: int, *, softmax_scale: float,
                  compute_dtype) -> jax.Array:
    """Softmax over each query's chosen entries only (DeepSeek Sparse Attention) -> o_lat [B, W, H, C]
    float32. `chosen` [B, W, K] int: j < `slots` (S, a row's cache slots) is cache slot j, S + w the
    call's own entry w (`own` as in `attend`: exact, not rounded), -1 none; every query has at least
    one. `chosen_rows`: the chosen cache entries (`read_chosen`): B x W x K rows, whatever the cache
    length."""
    dt, f32 = compute_dtype, jnp.float32
    mine_BxWxKx1 = jnp.clip(chosen_BxWxK - slots, 0, chosen_BxWxK.shape[1] - 1)[..., None]
    from_own = (chosen_BxWxK >= slots)[..., None]
    lat_BxWxKxC, k_pe_BxWxKxR = (
        jnp.where(from_own, jnp.take_along_axis(own_BxWxX[:, None].astype(dt), mine_BxWxKx1, axis=2), cached)
        for own_BxWxX, cached in zip(own, chosen_rows))  # a row's own entries, gathered within the row
    scores = (jnp.einsum("BWHC,BWKC->BWHK", q_lat_BxWxHxC.astype(dt), lat_BxWxKxC, preferred_element_type=f32)
              + jnp.einsum("BWHR,BWKR->BWHK", q_pe_BxWxHxR.astype(dt), k_pe_BxWxKxR, preferred_element_type=f32))
    p = jax.nn.softmax(jnp.where(chosen_BxWxK[:, :, None, :] >= 0, scores * softmax_scale, -jnp.inf), axis=-1)
    return jnp.einsum("BWHK,BWKC->BWHC", p.astype(dt), lat_BxWxKxC, preferred_element_type=f32)


def attend_sparse_pallas(q_lat_BxWxHxC, q_pe_BxWxHxR, cache, own, chosen_BxWxK, *, softmax_scale: float,
                         compute_dtype, layer=None, page_table=None) -> jax.Array:
    """`attend_sparse` for one query per row: the sparse Pallas decode kernel over the chosen cache
    rows (with a `page_table`, the pool's slots they live in), merged with the token's own entry (if
    chosen) by log-sum-exp -> [B, 1, H, C] float32."""
    q_lat, q_pe, latent, k_pe, scale = _decode_operands(q_lat_BxWxHxC, q_pe_BxWxHxR, cache, layer, compute_dtype)
    s, chosen_BxK = row_slots(latent, page_table), chosen_BxWxK[:, 0]
    indices_BxK = jnp.where(chosen_BxK < s, chosen_BxK, -1)  # the own entry (S) is merged below
    if page_table is not None:  # the pool's slot page * K + offset; no page: page N, past the pool, no entry
        page_BxK, offset_BxK = cache_index(indices_BxK, page_table, latent.shape[:2])
        indices_BxK = jnp.where(indices_BxK >= 0, page_BxK * latent.shape[1] + offset_BxK, -1)
    o_BxHxC, lse_BxH = pallas_kernels.sparse_mla_decode(q_lat, q_pe, latent, k_pe, indices_BxK,
                                                        softmax_scale=softmax_scale, kv_scale=scale,
                                                        paged=page_table is not None)
    own_kept_B = jnp.any(chosen_BxK == s, axis=-1)
    return _merge_own(o_BxHxC, lse_BxH, q_lat, q_pe, own, own_kept_B, softmax_scale, compute_dtype)

"""DeepSeek Sparse Attention's selection for one decode query: lightning-indexer scores, then top-k.

score[b,s] = sum_n w[b,n] * ReLU(q[b,n] . k[b,s]) for cache positions s < lengths[b] (-inf from
there on), over N index heads of dim D (64 x 128 in V3.2); the query then attends to the
`topk` best-scoring positions (`topk_indices`, -1 where fewer than `topk` are visible).
The indexer's own scales (HF: head_dim ** -0.5 inside the ReLU, n_heads ** -0.5 on the weights; a
quantised query's per-head scale) are positive, so they fold into `w`.

Two stages, as in DeepSeek's own inference (an FP8 score kernel, then a top-k outside it): the
score kernel reads the index-key cache once, block by block (on TPU, blocks past `lengths[b]`
issue no DMA), and `lax.top_k` picks the entries. A top-k inside the kernel is not sensible here:
neither Mosaic TPU nor Pallas Triton lowers `sort` or `top_k` in jax 0.10, and a selection over
128K scores spread across the grid's blocks needs a cross-block merge that XLA's top-k already is.

Index-key cache: bf16 / fp32 as it is, or fp8 (e4m3) / int8 with one positive fp32 scale per row
(`k_scale` [B,S,1], DeepSeek's layout for a 128-wide key), applied to the row's score:
ReLU(q . k_q * s) = s * ReLU(q . k_q) for s > 0, so a block's keys enter the dot as their 8-bit
values (cast exactly to q's dtype) and the scales multiply [block_s] scores, not [block_s, D] keys.

Letters: B batch, N index heads, D index head dim, S cache length, K selected entries.
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
    """`block_s` cache positions per program (None: 512 on TPU; 64 on Triton, whose [N, block_s]
    fp32 logits live in registers)."""

    block_s: int | None = None

    def validate(self, be: _backend.Backend) -> None:
        _backend.check_blocks(be, lanes=("block_s",), block_s=self.block_s_for(be))

    def block_s_for(self, be: _backend.Backend) -> int:
        return self.block_s or (512 if be.style == "tpu" else 64)


def _kernel(len_ref, q_ref, w_ref, k_ref, *refs, block_s, quantized):
    sc_ref, o_ref = refs if quantized else (None, refs[0])
    b, blk = pl.program_id(0), pl.program_id(1)
    start = blk * block_s
    length = len_ref[b]
    visible = start + lax.broadcasted_iota(jnp.int32, (1, block_s), 1) < length
    q = q_ref[...]
    k = k_ref[...].astype(q.dtype)
    logits_NxS = jnp.maximum(dot_f32(q, k, "NT"), 0.0)
    score_1xS = jnp.sum(w_ref[...] * logits_NxS, axis=0, keepdims=True)
    if quantized:
        score_1xS = score_1xS * sc_ref[...]
    o_ref[...] = jnp.where(visible, score_1xS, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("block_sizes", "backend", "interpret"))
def indexer_scores(q_BxNxD, w_BxN, k_BxSxD, lengths_B, *, k_scale=None, block_sizes: BlockSizes | None = None,
                   backend=None, interpret=None):
    """-> scores [B,S] f32: sum_n w[b,n] * ReLU(q[b,n] . k[b,s]) (times k_scale[b,s] for an 8-bit
    `k_BxSxD`), -inf at s >= lengths[b]. q: bf16/fp32 (an 8-bit key is multiplied in q's dtype)."""
    be = _backend.resolve(backend, interpret)
    bs = block_sizes or BlockSizes()
    bs.validate(be)
    b, n, d = q_BxNxD.shape
    s = k_BxSxD.shape[1]
    if w_BxN.shape != (b, n) or k_BxSxD.shape != (b, s, d) or lengths_B.shape != (b,):
        raise ValueError(f"inconsistent shapes: {q_BxNxD.shape=}, {w_BxN.shape=}, {k_BxSxD.shape=}, "
                         f"{lengths_B.shape=}; want [B,N,D], [B,N], [B,S,D], [B]")
    quantized = k_scale is not None
    if quantized and k_scale.shape != (b, s, 1):
        raise ValueError(f"{k_scale.shape=} must be ({b}, {s}, 1): one scale per index-key row")
    bk = bs.block_s_for(be)
    sp = round_up(s, bk)
    npad = _backend.next_pow2(n) if be.style == "triton" else round_up(n, 8)
    dp = _backend.pad_feature(be, d)
    q = pad_axis(pad_axis(q_BxNxD, 1, npad), 2, dp)
    w = pad_axis(w_BxN.astype(jnp.float32), 1, npad)[..., None]
    inputs = [q, w, pad_axis(pad_axis(k_BxSxD, 1, sp), 2, dp)]
    if quantized:
        inputs.append(pad_axis(k_scale.astype(jnp.float32).reshape(b, 1, s), 2, sp))
    lengths = jnp.clip(lengths_B.astype(jnp.int32), 0, s)
    kernel = functools.partial(_kernel, block_s=bk, quantized=quantized)
    out_shape = jax.ShapeDtypeStruct((b, 1, sp), jnp.float32)
    def k_map(bi, j, *len_ref):  # TPU (lengths prefetched): clamped to the last visible block, no DMA past it
        if len_ref:
            j = jnp.minimum(j, jnp.maximum(pl.cdiv(len_ref[0][bi], bk) - 1, 0))
        return bi, j, 0

    def per_row(bi, j, *len_ref):
        return bi, 0, 0

    def along_s(bi, j, *len_ref):  # a key block's scales, the same block as its keys
        return bi, 0, k_map(bi, j, *len_ref)[1]

    in_specs = [pl.BlockSpec((None, npad, dp), per_row), pl.BlockSpec((None, npad, 1), per_row),
                pl.BlockSpec((None, bk, dp), k_map)] + ([pl.BlockSpec((None, 1, bk), along_s)] if quantized else [])
    out_specs = pl.BlockSpec((None, 1, bk), lambda bi, j, *len_ref: (bi, 0, j))
    if be.style == "tpu":
        grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(b, sp // bk), in_specs=in_specs,
                                                 out_specs=out_specs)
    else:
        grid_spec = pl.GridSpec(grid=(b, sp // bk), in_specs=[pl.BlockSpec((b,), lambda bi, j: (0,))] + in_specs,
                                out_specs=out_specs)
    scores = _backend.pallas_call(be, kernel, name="indexer_scores", out_shape=out_shape,
                                  grid_spec=grid_spec)(lengths, *inputs)
    return scores[:, 0, :s]


def indexer_scores_reference(q_BxNxD, w_BxN, k_BxSxD, lengths_B, *, k_scale=None, **_):
    """Plain-jnp `indexer_scores` (fp32, full precision)."""
    f32 = jnp.float32
    logits_BxNxS = jnp.einsum("bnd,bsd->bns", q_BxNxD.astype(f32), k_BxSxD.astype(f32),
                              precision=lax.Precision.HIGHEST)
    scores_BxS = jnp.einsum("bn,bns->bs", w_BxN.astype(f32), jax.nn.relu(logits_BxNxS),
                            precision=lax.Precision.HIGHEST)
    if k_scale is not None:
        scores_BxS = scores_BxS * k_scale[..., 0].astype(f32)
    visible_BxS = jnp.arange(k_BxSxD.shape[1])[None, :] < lengths_B[:, None]
    return jnp.where(visible_BxS, scores_BxS, -jnp.inf)


def topk_indices(scores_BxS: jax.Array, topk: int) -> jax.Array:
    """int32 [B, topk]: the positions of the `topk` highest scores, best first; -1 for entries whose
    score is -inf (fewer than `topk` visible positions), as `sparse_mla_decode` takes them."""
    s = scores_BxS.shape[1]
    scores_BxS = pad_axis(scores_BxS, 1, max(s, topk), value=-jnp.inf)
    values_BxK, idx_BxK = lax.top_k(scores_BxS, topk)
    return jnp.where(values_BxK > -jnp.inf, idx_BxK, -1).astype(jnp.int32)

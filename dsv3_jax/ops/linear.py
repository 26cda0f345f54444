"""Projections: x contracted with the leading axes of a weight, in the compute dtype or in FP8.

FP8 is the DeepSeek-V3 training recipe (paper section 3.3; docs/fp8.md): all three GEMMs of a
linear layer run on e4m3 operands with fine-grained scales (`scale = amax / 448`), each 128-wide
block of the contraction accumulated and scaled in fp32 (`pallas_kernels.fp8_matmul`):

- Fprop  y = x . w:      x in 1x128 tiles (per token, 128 features), w in 128x128 blocks.
- Dgrad  dx = dy . w^T:  dy in 1x128 tiles, the forward's 128x128 weight blocks transposed.
- Wgrad  dw = x^T . dy:  the contraction is the token axis, so x and dy are both quantised in
                         128x1 tiles (128 tokens, one feature).

Every scale is the tile's own `amax / 448`, as in the paper: the amax floor (`MIN_AMAX`) only
guards all-zero tiles. DeepGEMM's floor of 1e-4 (the quantiser's default, kept for inference)
would coarsen gradients, whose entries shrink with the tokens a step averages over (~1/tokens).
What the backward needs is saved in FP8 with its scales: x as its 128x1 tiles, w as its forward
blocks; the bf16/fp32 input is not kept. Master weights and the returned gradients stay in their
own dtypes. Letters: M tokens (rows), K input features, N output features, G groups (experts).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from dsv3_jax.ops import quant
from dsv3_jax.ops.quant import QArray

MIN_AMAX = 1e-30  # guards 0/0 only; amax / 448 stays a normal fp32


def _on_platform(kernel, reference):
    """`kernel` (Pallas) in a program lowered for TPU or GPU, else its jnp twin `reference`, which
    computes the same quantised products in the same promotion order."""
    def run(*args, **kwargs):
        return jax.lax.platform_dependent(*args, cpu=functools.partial(reference, **kwargs),
                                          default=functools.partial(kernel, **kwargs))
    return run


# Each chosen for the platform the program is lowered for.
_matmul = _on_platform(pk.fp8_matmul, pk.fp8_matmul_reference)
_grouped_matmul = _on_platform(pk.fp8_grouped_matmul, pk.fp8_grouped_matmul_reference)
_grouped_wgrad = _on_platform(pk.fp8_grouped_wgrad, pk.fp8_grouped_wgrad_reference)


def _quantize_tokens(a_MxK, scale_fmt: str | None = None):
    """1x128 tiles along the feature axis: ([M,K] e4m3, [M,KB] scales). "ue8m0": DeepSeek's V3.1
    activation recipe, max(amax, 1e-4) / 448 rounded up to a power of two."""
    if scale_fmt == "ue8m0":
        return pk.quantize_1x128(a_MxK.astype(jnp.float32), pow2_scale=True, min_amax=quant.FP8_MIN_AMAX)
    return pk.quantize_1x128(a_MxK.astype(jnp.float32), min_amax=MIN_AMAX)


def _quantize_tokens_t(a_MxK):
    """128x1 tiles (128 tokens, one feature), stored transposed: ([K,M] e4m3, [K,MB] scales)."""
    return _quantize_tokens(a_MxK.T)


def _quantize_weight_t(w_KxN):
    """128x128 blocks of w^T: ([N,K] e4m3, [NB,KB] scales), per group for w [G, K, N]; transposed,
    the same blocks serve Dgrad."""
    quantize = functools.partial(pk.quantize_128x128, min_amax=MIN_AMAX)
    w_NxK = jnp.swapaxes(w_KxN, -1, -2).astype(jnp.float32)
    return quantize(w_NxK) if w_NxK.ndim == 2 else jax.vmap(quantize)(w_NxK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_matmul(x_MxK: jax.Array, w_KxN: jax.Array, group_sizes_G: jax.Array | None, out_dtype) -> jax.Array:
    """x . w with all three GEMMs in FP8 (module docstring). Returns [M, N] in `out_dtype`.

    With `group_sizes_G`, rows sorted by group times their group's weight (w [G, K, N], experts).
    Wgrad then contracts each group's tokens: they are laid out group-aligned (every 128-token tile
    in one group, `pallas_kernels.fp8_grouped_wgrad`) before the 128x1 quantisation.
    """
    return _fp8_fwd(x_MxK, w_KxN, group_sizes_G, out_dtype)[0]


def _fp8_fwd(x_MxK, w_KxN, sizes_G, out_dtype):
    w_q, w_s = _quantize_weight_t(w_KxN)
    y_MxN = _fp8_matmul(*_quantize_tokens(x_MxK), w_q, w_s, sizes_G, out_dtype=out_dtype)
    xt = _quantize_tokens_t(x_MxK) if sizes_G is None else _group_aligned_t(x_MxK, sizes_G)[0]
    carriers = (jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_KxN.dtype))  # the gradients' dtypes
    return y_MxN, (xt, (w_q, w_s), sizes_G, *carriers)


def _dgrad(dy_MxN, w_q, w_s, sizes_G=None):
    """dx = dy . w^T in FP8, the recipe's Dgrad: dy in 1x128 tiles against the weight's stored
    128x128 blocks transposed (last two axes swapped); rows sorted by group when `sizes_G` is given.
    Returns fp32 [M, K]."""
    w_t = (jnp.swapaxes(w_q, -1, -2), jnp.swapaxes(w_s, -1, -2))
    return _fp8_matmul(*_quantize_tokens(dy_MxN), *w_t, sizes_G, out_dtype=jnp.float32)


def _fp8_bwd(out_dtype, res, dy_MxN):
    (xt_q, xt_s), (w_q, w_s), sizes_G, x_like, w_like = res
    dx_MxK = _dgrad(dy_MxN, w_q, w_s, sizes_G)
    if sizes_G is None:
        dw_KxN = _matmul(xt_q, xt_s, *_quantize_tokens_t(dy_MxN), out_dtype=jnp.float32)
    else:
        (dyt_q, dyt_s), tile_group = _group_aligned_t(dy_MxN, sizes_G)
        dw_KxN = _grouped_wgrad(xt_q, xt_s, dyt_q, dyt_s, tile_group, sizes_G, out_dtype=jnp.float32)
    return dx_MxK.astype(x_like.dtype), dw_KxN.astype(w_like.dtype), None


fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)


def _group_aligned_t(a_MxK, sizes_G):
    """128x1 tiles of each group's tokens: ([K,T] e4m3, [K,TB] scales), T in the aligned layout."""
    dest_M, tile_group = pk.group_aligned_rows(sizes_G, a_MxK.shape[0])
    a_TxK = jnp.zeros((tile_group.shape[0] * 128, a_MxK.shape[1]), jnp.float32)
    a_TxK = a_TxK.at[dest_M].set(a_MxK.astype(jnp.float32), mode="drop")
    return _quantize_tokens_t(a_TxK), tile_group


def _flatten(x, w, contract: int):
    k = math.prod(w.shape[:contract])
    return x.reshape(-1, k), w.reshape(k, -1)


def project(x: jax.Array, w: jax.Array, *, contract: int, compute_dtype, fp8: bool = False,
            lora: tuple | None = None) -> jax.Array:
    """x [..., *w.shape[:contract]] . w -> [..., *w.shape[contract:]] in `compute_dtype`.

    The plain path is one einsum with fp32 accumulation; `fp8` routes through `fp8_matmul`.
    `lora` (a [*w.shape[:contract], r], b [r, *w.shape[contract:]], scale[, dropout]) adds the
    low-rank update scale * (x a) b (LoRA, Hu et al. 2021), computed through the same projection in
    the compute dtype (never FP8: the adapters are small and trained in full precision); with
    dropout = (rate, key data), x a becomes `dropout(x, rate, key) a` (the adapter's input only).
    """
    y = _project(x, w, contract, compute_dtype, fp8)
    if lora is None:
        return y
    a, b, scale, *drop = lora
    u = _project(x if not drop or drop[0] is None else dropout(x, *drop[0]), a, contract, compute_dtype, False)
    return (y + scale * _project(u, b, 1, compute_dtype, False)).astype(compute_dtype)


def dropout(x: jax.Array, rate: float, key_data: jax.Array) -> jax.Array:
    """Inverted dropout: each element of x zeroed with probability `rate`, the rest divided by
    1 - rate; the mask is Bernoulli(1 - rate) from the key (`key_data` [2] uint32) over x's shape."""
    keep = jax.random.bernoulli(jax.random.wrap_key_data(key_data), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _project(x, w, contract, compute_dtype, fp8):
    batch, out = x.shape[: x.ndim - contract], w.shape[contract:]
    if isinstance(w, QArray):  # stored quantized (dsv3_jax/ops/quant.py): its own format decides
        if w.contract != contract:
            raise ValueError(f"quantized weight {w.shape} contracts {w.contract} axes, the call {contract}")
        return _quant_matmul(x.reshape(-1, w.k), w, jnp.dtype(compute_dtype)).reshape(*batch, *out)
    x, w = x.astype(compute_dtype), w.astype(compute_dtype)
    if fp8:
        x2, w2 = _flatten(x, w, contract)
        return fp8_matmul(x2, w2, None, jnp.dtype(compute_dtype)).reshape(*batch, *out)
    return _plain_dot(x, w, contract).astype(compute_dtype)


def _quant_matmul(x_MxK: jax.Array, qa: QArray, compute_dtype) -> jax.Array:
    """x [M, K] . w for one quantized matrix (no stack axes) -> [M, N] in `compute_dtype`: FP8 through
    the block-scaled kernel, int formats dequantised once (ops/quant.py's numerics)."""
    if qa.fmt == "fp8":
        return fp8_matmul_stored(x_MxK, qa.q, qa.scale, None, compute_dtype, qa.scale_fmt)
    w_KxN = quant.dequantize_2d(qa, compute_dtype)
    return jnp.einsum("MK,KN->MN", x_MxK.astype(compute_dtype), w_KxN,
                      preferred_element_type=jnp.float32).astype(compute_dtype)


def _plain_dot(x, w, contract: int) -> jax.Array:
    """x . w over w's first `contract` axes, fp32 accumulation: `dot_2d` on CPU, `dot_over_axes`
    elsewhere. XLA:CPU canonicalises a dot over several free or contracted axes with transposes,
    and for the weight gradient (contracting B and T) it fused the backward's elementwise ops into
    a transposed copy that cost more than the matmuls (docs/benchmarks.md, Kernel choices). Elsewhere
    the dot keeps its axes, which a sharded lowering partitions as they are."""
    return jax.lax.platform_dependent(x, w, cpu=functools.partial(dot_2d, contract=contract),
                                      default=functools.partial(dot_over_axes, contract=contract))


def dot_over_axes(x, w, contract: int) -> jax.Array:
    """x [..., K...] . w [K..., N...] -> [..., N...] fp32, one dot_general over the axes as they are."""
    dims = ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def dot_2d(x, w, contract: int) -> jax.Array:
    """The same product as one [M, K] x [K, N] matmul between reshapes."""
    batch, out = x.shape[: x.ndim - contract], w.shape[contract:]
    x_MxK, w_KxN = _flatten(x, w, contract)
    return jnp.dot(x_MxK, w_KxN, preferred_element_type=jnp.float32).reshape(*batch, *out)


def _fp8_matmul(x_q, x_s, w_q, w_s, sizes_G=None, *, out_dtype):
    """The block-scaled kernel on quantised operands: rows sorted by group when `sizes_G` is given."""
    if sizes_G is None:
        return _matmul(x_q, x_s, w_q, w_s, out_dtype=out_dtype)
    return _grouped_matmul(x_q, x_s, w_q, w_s, sizes_G, out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fp8_matmul_stored(x_MxK: jax.Array, w_q_NxK: jax.Array, w_scale: jax.Array, group_sizes_G: jax.Array | None,
                      out_dtype, scale_fmt: str | None = None) -> jax.Array:
    """x . w for a weight stored in FP8 (e4m3 [N, K] with 128x128 `scale_inv` blocks, as released):
    the activations quantised in 1x128 tiles (power-of-two scales for `scale_fmt="ue8m0"`, the
    weight's own format), the block-scaled kernel, no dequantised copy of w.
    With `group_sizes_G`, rows sorted by group (experts), each through its group's weight
    (w_q [G, N, K]). Returns [M, N] in `out_dtype`. The weight is frozen (inference, QLoRA): the
    backward is Dgrad alone, dy in 1x128 tiles against the stored blocks transposed (as
    `fp8_matmul`'s); w gets none."""
    return _stored_fwd(x_MxK, w_q_NxK, w_scale, group_sizes_G, out_dtype, scale_fmt)[0]


def _stored_fwd(x_MxK, w_q_NxK, w_scale, sizes_G, out_dtype, scale_fmt=None):
    y_MxN = _fp8_matmul(*_quantize_tokens(x_MxK, scale_fmt), w_q_NxK, w_scale, sizes_G, out_dtype=out_dtype)
    return y_MxN, (w_q_NxK, w_scale, sizes_G, jnp.zeros((0,), x_MxK.dtype))


def _stored_bwd(out_dtype, scale_fmt, res, dy_MxN):
    w_q, w_scale, sizes_G, x_like = res
    return _dgrad(dy_MxN, w_q, w_scale, sizes_G).astype(x_like.dtype), None, None, None


fp8_matmul_stored.defvjp(_stored_fwd, _stored_bwd)

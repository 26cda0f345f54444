"""Quantized weights for inference: int8 / int4 weight-only with group-wise scales, and FP8 (e4m3)
with 128x128 block scales as the released DeepSeek-V3 checkpoint stores them.

A weight of ours with logical shape [*stack, *slice] (stack: leading `layers` / `expert` axes;
slice: `contract` contraction axes then output axes) is held as a `QArray`, each stack element
a 2-D matrix over K = prod(contraction axes) and N = prod(output axes):

- `int8`: q int8 [*stack, K, N], scale f32 [*stack, K/g, N]; w[k, n] = q[k, n] * scale[k // g, n].
  scale = amax over the group / 127, q = round(w / scale) (symmetric, round half to even).
- `int4`: as int8 with scale = amax / 7 and q in [-7, 7], packed two per byte along K: within
  each group of g rows, packed row i holds row i (low nibble) and row i + g/2 (high nibble), two's
  complement, so q uint8 [*stack, K/2, N]. Unpacking a group is one concatenation, no interleave.
- `fp8`: q e4m3 [*stack, N, K] and scale_inv f32 [*stack, ceil(N/128), ceil(K/128)]: the HF
  orientation ([out, in]) the released weights and `pallas_kernels.fp8_matmul` use. With
  `scale_fmt="ue8m0"` (V3.1's checkpoints) every scale is a power of two, rounded up, and so are
  the scales of the activations quantised against the weight (DeepSeek's V3.1 inference recipe).

The group g is `group` (128 by default) or K when K is smaller; K must be a multiple of it.
Numerics of every int path (the dense reference, the tile loop, the Pallas kernel): w = fp32(q) * scale rounded once to the
compute dtype, then x . w with fp32 accumulation. FP8 runs the block-scaled matmul with the
activations quantised in 1x128 tiles (dsv3_jax/ops/linear.py). Quantized weights are for inference:
they take no gradient.

Letters: K contraction, N output, G = K / g groups, E experts.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels import quantize_128x128  # the kernels' quantiser: the recipe the kernels expect

FORMATS = ("fp8", "int8", "int4")
QMAX = {"int8": 127.0, "int4": 7.0}
FP8_BLOCK = 128
E4M3_MAX = 448.0
FP8_MIN_AMAX = 1e-4  # the released checkpoint's floor (DeepGEMM's)
INT_MIN_AMAX = 1e-12  # guards all-zero groups only


def check_format(fmt: str, where: str = "weights") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"{where}={fmt!r} is not a weight format; expected one of {FORMATS} (or None)")
    return fmt


def group_for(k: int, group: int, fmt: str, name: str = "weight") -> int:
    """The group along K actually used: `group`, or K when K is smaller. Raises where K does not split."""
    if group <= 0:
        raise ValueError(f"quantization group must be positive, got {group}")
    g = min(group, k)
    if k % g:
        raise ValueError(f"{name}: contraction size {k} is not a multiple of the {fmt} group {g}; pick another group")
    if fmt == "int4" and g % 2:
        raise ValueError(f"{name}: int4 packs pairs of rows and needs an even group, got {g}")
    return g


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized weight (module docstring). Behaves like the weight where the model reads it:
    `shape` / `ndim` are the logical ones, `w[i]` indexes leading stack axes, `astype` is a no-op
    (the matmul dequantises)."""

    q: jax.Array
    scale: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    slice_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # one stack element's logical shape
    contract: int = dataclasses.field(metadata=dict(static=True))  # contraction axes at the front of slice_shape
    group: int = dataclasses.field(metadata=dict(static=True))  # int formats: rows of K per scale
    scale_fmt: str | None = dataclasses.field(default=None, metadata=dict(static=True))  # fp8: None or "ue8m0"

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-2])

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack_shape + tuple(self.slice_shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def k(self) -> int:
        return math.prod(self.slice_shape[:self.contract])

    @property
    def nbytes(self) -> int:
        return int(self.q.size * self.q.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)

    @property
    def dtype(self):
        return self.q.dtype

    def astype(self, dtype) -> "QArray":
        del dtype  # dequantised inside the matmul, into the activations' dtype
        return self

    def __getitem__(self, index) -> "QArray":
        if index is Ellipsis:
            return self
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(self.stack_shape):
            raise IndexError(f"a quantized weight indexes its stack axes {self.stack_shape} only, got {index}")
        return dataclasses.replace(self, q=self.q[index], scale=self.scale[index])


# ---- int4 packing (numpy and jnp alike: `xp` is either module) ----

def pack_int4(q_KxN, group: int, xp=jnp):
    """int values in [-8, 7], [..., K, N] -> uint8 [..., K/2, N]: per group, row i low, row i + g/2 high."""
    *lead, k, n = q_KxN.shape
    half = group // 2
    q = q_KxN.reshape(*lead, k // group, 2, half, n).astype(xp.int8)
    lo, hi = q[..., 0, :, :].astype(xp.uint8) & 0xF, q[..., 1, :, :].astype(xp.uint8) & 0xF
    return (lo | (hi << 4)).astype(xp.uint8).reshape(*lead, k // 2, n)


def unpack_int4(p_KhxN, group: int, xp=jnp):
    """Inverse of `pack_int4`: uint8 [..., K/2, N] -> int8 [..., K, N]."""
    *lead, kh, n = p_KhxN.shape
    half = group // 2
    p = p_KhxN.reshape(*lead, kh // half, half, n).astype(xp.uint8)
    lo, hi = (p & 0xF).astype(xp.int8), (p >> 4).astype(xp.int8)
    lo, hi = xp.where(lo > 7, lo - 16, lo), xp.where(hi > 7, hi - 16, hi)
    return xp.concatenate([lo, hi], axis=-2).reshape(*lead, kh * 2, n).astype(xp.int8)


# ---- quantizing one [K, N] matrix (int) or [N, K] (fp8) ----

def quantize_int(w_KxN, fmt: str, group: int, xp=jnp):
    """float [..., K, N] -> (q [..., K, N] int8 or packed uint8 [..., K/2, N], scale f32 [..., K/g, N])."""
    *lead, k, n = w_KxN.shape
    w = w_KxN.astype(xp.float32).reshape(*lead, k // group, group, n)
    amax = xp.max(xp.abs(w), axis=-2)
    scale = (xp.maximum(amax, INT_MIN_AMAX) / QMAX[fmt]).astype(xp.float32)
    q = xp.clip(xp.round(w / scale[..., None, :]), -QMAX[fmt], QMAX[fmt]).astype(xp.int8).reshape(*lead, k, n)
    return (pack_int4(q, group, xp) if fmt == "int4" else q), scale


def dequantize_2d(qa: QArray, dtype=jnp.float32) -> jax.Array:
    """[..., K, N] in `dtype`: fp32(q) * scale rounded once (fp8: the [N, K] blocks transposed)."""
    if qa.fmt == "fp8":
        n, k = qa.q.shape[-2:]
        s = jnp.repeat(jnp.repeat(qa.scale, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :n, :k]
        return jnp.swapaxes(qa.q.astype(jnp.float32) * s, -1, -2).astype(dtype)
    s = jnp.repeat(qa.scale, qa.group, axis=-2)
    q = unpack_int4(qa.q, qa.group) if qa.fmt == "int4" else qa.q
    return (q.astype(jnp.float32) * s).astype(dtype)


def dequantize(qa: QArray, dtype=jnp.float32) -> jax.Array:
    """The weight in its logical shape [*stack, *slice_shape], in `dtype`."""
    return dequantize_2d(qa, dtype).reshape(qa.shape)


def as_dense(w, dtype) -> jax.Array:
    """`w` in `dtype`, dequantised if quantized: for the few uses that need the matrix itself
    (MLA's absorbed form reads wkv_b per head; one layer's small matrix)."""
    return dequantize(w, dtype) if isinstance(w, QArray) else w.astype(dtype)


def quantize(w, fmt: str, *, contract: int, stack: int = 0, group: int = 128, name: str = "weight",
             scale_fmt: str | None = None) -> QArray:
    """A weight [*stack, *slice] (jnp) -> QArray; `stack` leading axes are kept as they are.
    `scale_fmt` ("ue8m0": power-of-two block scales) applies to fp8 only."""
    check_format(fmt)
    slice_shape = tuple(w.shape[stack:])
    k, n = math.prod(slice_shape[:contract]), math.prod(slice_shape[contract:])
    w_KxN = jnp.asarray(w, jnp.float32).reshape(*w.shape[:stack], k, n)
    if fmt == "fp8":
        flat = jnp.swapaxes(w_KxN, -1, -2).reshape(-1, n, k)
        pow2 = scale_fmt == "ue8m0"
        q, s = jax.vmap(lambda a: quantize_128x128(a, pow2_scale=pow2, min_amax=FP8_MIN_AMAX))(flat)
        q, s = q.reshape(*w.shape[:stack], *q.shape[1:]), s.reshape(*w.shape[:stack], *s.shape[1:])
        return QArray(q, s, fmt, slice_shape, contract, FP8_BLOCK, scale_fmt)
    g = group_for(k, group, fmt, name)
    q, s = quantize_int(w_KxN, fmt, g)
    return QArray(q, s, fmt, slice_shape, contract, g)


def physical_shapes(fmt: str, stack_shape: tuple[int, ...], k: int, n: int, group: int):
    """((q shape, q dtype), (scale shape, f32)) of a weight with this stack and K x N slices."""
    st = tuple(stack_shape)
    if fmt == "fp8":
        return (st + (n, k), jnp.float8_e4m3fn), (st + (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), jnp.float32)
    rows = k // 2 if fmt == "int4" else k
    return (st + (rows, n), jnp.uint8 if fmt == "int4" else jnp.int8), (st + (k // group, n), jnp.float32)

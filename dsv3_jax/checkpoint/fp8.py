"""FP8 (e4m3) 128x128 block scales as the released DeepSeek-V3 weights store them (numpy, host side).

`weight_scale_inv` is fp32 [ceil(out/128), ceil(in/128)] and multiplies: w = fp32(q) * s[i//128, j//128],
rounded once to the target dtype. Edge blocks may be partial (576 rows -> 5 blocks). V3.1's
checkpoints (`scale_fmt: "ue8m0"`) hold powers of two in those fp32 scales; an export may store them
as float8_e8m0fnu (exponent only), which reads back as the same fp32 values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 128
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
MIN_AMAX = 1e-4
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
SCALE_DTYPES = (np.dtype(np.float32), E8M0)
_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)


def scale_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    return tuple(-(-n // block) for n in shape)


def dequantize(q: np.ndarray, scale_inv: np.ndarray, *, block: int = BLOCK, row0: int = 0,
               col0: int = 0) -> np.ndarray:
    """fp32(q) * s[i // 128, j // 128] (partial edge blocks allowed), in float32.

    `q` may be a window of the stored tensor starting at (row0, col0); `scale_inv` is then the
    window of the scales that covers it (`scale_window`), so a shard is dequantised without
    reading the rest of the tensor.
    """
    rows, cols = q.shape
    rb = np.arange(row0, row0 + rows) // block - row0 // block
    s_rows = np.asarray(scale_inv, np.float32)[rb]  # [rows, column blocks]: a few floats per row
    out = _E4M3_TO_F32[np.asarray(q).view(np.uint8)]  # a 256-entry table: several times faster than astype
    for j in range(col0 // block, -(-(col0 + cols) // block)):  # in place, one column block at a time
        lo, hi = max(j * block - col0, 0), min((j + 1) * block - col0, cols)
        out[:, lo:hi] *= s_rows[:, j - col0 // block:j - col0 // block + 1]
    return out


def scale_window(rows: slice, cols: slice, block: int = BLOCK) -> tuple[slice, slice]:
    """The block rows and columns of `weight_scale_inv` that cover q[rows, cols] (both with start
    and stop set); pass them with row0=rows.start, col0=cols.start to `dequantize`."""
    return (slice(rows.start // block, -(-rows.stop // block)), slice(cols.start // block, -(-cols.stop // block)))


def dequantize_window(read_q, read_s, rows: slice, cols: slice, dtype, scratch_bytes: int = 64 << 20) -> np.ndarray:
    """q[rows, cols] dequantised into a new `dtype` array, with at most `scratch_bytes` of float32
    at a time (row blocks aligned to the 128-row scale blocks, so each scale row is read once):
    a window of a [18432, 7168] tensor costs its bf16 bytes, not twice that in float32 as well.
    `read_q(rows, cols)` gives the e4m3 window, `read_s(rows, cols)` a window of `scale_inv`;
    `rows` and `cols` have start and stop set."""
    out = np.empty((rows.stop - rows.start, cols.stop - cols.start), dtype)
    step = max(1, scratch_bytes // (4 * max(out.shape[1], 1)) // BLOCK) * BLOCK
    r0 = rows.start
    while r0 < rows.stop:
        r1 = min(rows.stop, (r0 // step + 1) * step)
        rs, cs = scale_window(slice(r0, r1), cols)
        out[r0 - rows.start:r1 - rows.start] = dequantize(read_q(slice(r0, r1), cols), read_s(rs, cs),
                                                          row0=r0, col0=cols.start)
        r0 = r1
    return out


def quantize(w: np.ndarray, *, block: int = BLOCK, pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] -> (e4m3 [out, in], fp32 scale_inv [ceil(out/128), ceil(in/128)]), DeepSeek recipe:
    scale = max(amax over the block's valid elements, 1e-4) / 448; `pow2` (UE8M0) rounds it up to a
    power of two, so |w / scale| <= 448 still holds.

    `pallas_kernels.quantize_128x128` is the same recipe in jnp; both exist because they differ
    by design in about half the scales (one ulp): numpy divides by 448 exactly, what the converter
    writes and the released checkpoint holds, while XLA compiles the division by the constant into
    a multiplication by fp32(1/448), what the model's in-memory quantization uses."""
    rows, cols = w.shape
    rb, cb = scale_shape(w.shape, block)
    padded = np.zeros((rb * block, cb * block), np.float32)
    padded[:rows, :cols] = w
    amax = np.abs(padded.reshape(rb, block, cb, block)).max(axis=(1, 3))
    scale = (np.maximum(amax, MIN_AMAX) / E4M3_MAX).astype(np.float32)
    if pow2:
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
    s = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:rows, :cols]
    q = np.clip(w.astype(np.float32) / s, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, scale


def not_pow2(s: np.ndarray) -> tuple[int, ...] | None:
    """The index of the first fp32 scale that is not a positive finite power of two, else None."""
    mantissa = np.frexp(s)[0]
    bad = np.argwhere(~((mantissa == 0.5) & np.isfinite(s)))
    return tuple(int(i) for i in bad[0]) if len(bad) else None


def quantizable(hf_name: str) -> bool:
    """Which HF tensors the released checkpoint stores in FP8: attention and MLP/expert projections,
    the V3.2 indexer's wq_b and wk. Norms, router, bias, embeddings, head, `eh_proj` and the
    indexer's `weights_proj` stay in higher precision."""
    if ".indexer." in hf_name:
        return hf_name.endswith((".wq_b.weight", ".wk.weight"))
    return hf_name.endswith("_proj.weight") and "eh_proj" not in hf_name and (
        ".self_attn." in hf_name or ".mlp." in hf_name)

"""Helpers for the pallas_kernels tests (imported by module name; tests/ is not a package)."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quantize_1x128

# (kernel style, platform given to `lower(lowering_platforms=...)`)
LOWERINGS = [("tpu", "tpu"), ("triton", "cuda")]


# The GPU a CUDA lowering targets from this CPU host: Triton lowers per compute capability, which
# newer jax (0.12) reads from the abstract mesh's device when no GPU is attached.
_CUDA_TARGET = jax.sharding.AbstractMesh((1,), ("gpu",), axis_types=(jax.sharding.AxisType.Auto,),
                                         abstract_device=jax.sharding.AbstractDevice(
                                             device_kind="NVIDIA H100", num_cores=132, platform="gpu"))


def lowers(fn, args, platform):
    """`jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))` (for "cuda": an H100's); raises
    on failure."""
    lower = lambda: jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))  # noqa: E731
    if platform != "cuda":
        return lower()
    with jax.sharding.use_abstract_mesh(_CUDA_TARGET):
        return lower()


def numpy_promoted_matmul(x_q, x_s, w_q, w_s):
    """out = sum_kb (x[:, kb] @ w[:, kb].T in fp32) * xs[:, kb] * ws[n//128, kb], fp32 throughout.

    A per-row w_s ([N, KB], the Wgrad GEMM's 1x128 activation tiles) is indexed by n instead."""
    x = np.asarray(x_q).astype(np.float32)
    w = np.asarray(w_q).astype(np.float32)
    x_s, w_s = np.asarray(x_s, np.float32), np.asarray(w_s, np.float32)
    m, k = x.shape
    n = w.shape[0]
    out = np.zeros((m, n), np.float32)
    row_block = np.arange(n) if w_s.shape[0] == n else np.arange(n) // 128
    for kb in range(-(-k // 128)):
        cols = slice(kb * 128, (kb + 1) * 128)
        part = x[:, cols] @ w[:, cols].T
        out += part * x_s[:, kb:kb + 1] * w_s[row_block, kb][None, :]
    return out


def quantized_cache(kv, fmt):
    """(cache, kv_scale [B,S,G], dequantised float64) for kv [B,S,R]: fp8 with 1x128 scales, or int8
    with one scale per token (amax / 127) repeated over the token's G groups, as dsv3_jax's int8
    cache hands it."""
    b, s, r = kv.shape
    if fmt == "float8":
        q, scale = quantize_1x128(kv.reshape(b * s, r))
        q, scale = q.reshape(b, s, r), scale.reshape(b, s, -1)
    else:
        tok = np.abs(np.asarray(kv)).max(-1, keepdims=True) / 127.0
        q = jnp.asarray(np.clip(np.round(np.asarray(kv) / tok), -127, 127).astype(np.int8))
        scale = jnp.asarray(np.repeat(tok, -(-r // 128), axis=-1), jnp.float32)
    deq = np.asarray(q, np.float64) * np.repeat(np.asarray(scale, np.float64), 128, axis=-1)[..., :r]
    return q, scale, deq

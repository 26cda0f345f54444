"""Helpers for the pallas_kernels tests (imported by module name; tests/ is not a package)."""

import jax
import numpy as np

# (kernel style, platform given to `lower(lowering_platforms=...)`)
LOWERINGS = [("tpu", "tpu"), ("triton", "cuda")]


def lowers(fn, args, platform):
    """`jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))`; raises on failure."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))


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

"""fp8_matmul against an independent numpy emulation of the per-128-K-block promotion."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (BlockSizesFp8, fp8_matmul, fp8_matmul_reference, quantize_1x128,
                            quantize_128x128)
from pallas_test_utils import LOWERINGS, lowers, numpy_promoted_matmul


def _operands(m, n, k, pow2=False, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32) * rng.uniform(0.1, 4, size=(m, 1))
    w = rng.normal(size=(n, k)).astype(np.float32) * 0.05
    return x, w, (*quantize_1x128(x, pow2_scale=pow2), *quantize_128x128(w, pow2_scale=pow2))


CASES = [  # (m, n, k, block_sizes)
    (128, 128, 128, BlockSizesFp8()),
    (200, 260, 300, BlockSizesFp8()),
    (1, 130, 520, BlockSizesFp8(block_k=256)),
    (64, 128, 384, BlockSizesFp8(block_m=64, block_k=128)),
]


@pytest.mark.parametrize("m,n,k,bs", CASES)
def test_fp8_matmul_matches_numpy_promotion(m, n, k, bs, style):
    x, w, ops = _operands(m, n, k, pow2=(m == 1))
    out = fp8_matmul(*ops, out_dtype=jnp.float32, block_sizes=bs, backend=style, interpret=True)
    want = numpy_promoted_matmul(*ops)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert np.abs(np.asarray(out) - want).max() / np.abs(want).max() < 1e-5
    ref = fp8_matmul_reference(*ops, out_dtype=jnp.float32)
    assert np.abs(np.asarray(ref) - want).max() / np.abs(want).max() < 1e-5
    # Against the unquantised fp32 product: the FP8 recipe stays close.
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    o = np.asarray(out, np.float64)
    assert 1 - 2 * np.sum(o * exact) / np.sum(o**2 + exact**2) < 1e-3


def test_fp8_matmul_bf16_out_and_errors():
    _, _, ops = _operands(16, 128, 128)
    out = fp8_matmul(*ops, out_dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="block_k=100 must be a multiple of 128"):
        fp8_matmul(*ops, out_dtype=jnp.float32, block_sizes=BlockSizesFp8(block_k=100))
    with pytest.raises(ValueError, match="scale"):
        fp8_matmul(ops[0], ops[1][:, :0], ops[2], ops[3], out_dtype=jnp.float32)


@pytest.mark.parametrize("style_,platform", LOWERINGS)
def test_fp8_matmul_lowers(style_, platform):
    _, _, ops = _operands(200, 260, 300)
    f = functools.partial(fp8_matmul, out_dtype=jnp.bfloat16, backend=style_, interpret=False)
    lowers(f, ops, platform)


@pytest.mark.parametrize("m,n,k", [(130, 200, 256), (64, 128, 384)])
def test_fp8_matmul_per_row_rhs_scale(m, n, k, style):
    """The Wgrad GEMM: both operands activations in 1x128 tiles along the contraction (tokens)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(m, k)).astype(np.float32)
    g = rng.normal(size=(n, k)).astype(np.float32) * rng.uniform(0.01, 2, size=(n, 1))
    ops = (*quantize_1x128(x), *quantize_1x128(g))
    assert ops[3].shape == (n, -(-k // 128))
    out = fp8_matmul(*ops, out_dtype=jnp.float32, backend=style, interpret=True)
    want = numpy_promoted_matmul(*ops)
    assert np.abs(np.asarray(out) - want).max() / np.abs(want).max() < 1e-5
    ref = fp8_matmul_reference(*ops, out_dtype=jnp.float32)
    assert np.abs(np.asarray(ref) - want).max() / np.abs(want).max() < 1e-5
    exact = x.astype(np.float64) @ g.T.astype(np.float64)
    o = np.asarray(out, np.float64)
    assert 1 - 2 * np.sum(o * exact) / np.sum(o**2 + exact**2) < 1e-3

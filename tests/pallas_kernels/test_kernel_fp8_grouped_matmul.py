"""fp8_grouped_matmul (MoE contiguous layout) against per-group numpy promotion emulation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (BlockSizesFp8, fp8_grouped_matmul, fp8_grouped_matmul_reference,
                            quantize_1x128, quantize_128x128)
from pallas_test_utils import LOWERINGS, lowers, numpy_promoted_matmul


def _operands(m, g, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(g, n, k)).astype(np.float32) * 0.05
    wq, ws = zip(*[quantize_128x128(w[i]) for i in range(g)])
    return x, w, (*quantize_1x128(x), jnp.stack(wq), jnp.stack(ws))


def numpy_grouped(x_q, x_s, w_q, w_s, sizes):
    out = np.zeros((x_q.shape[0], w_q.shape[1]), np.float32)
    start = 0
    for gi, size in enumerate(sizes):
        rows = slice(start, start + size)
        out[rows] = numpy_promoted_matmul(x_q[rows], x_s[rows], w_q[gi], w_s[gi])
        start += size
    return out


CASES = [  # (M, N, K, group sizes): empty groups, 1-row group, rows past the total, tile crossings
    (150, 200, 260, [37, 0, 1, 100]),
    (64, 128, 128, [10, 20, 5]),
]


@pytest.mark.parametrize("m,n,k,sizes", CASES)
def test_fp8_grouped_matmul_matches_numpy(m, n, k, sizes, style):
    x, w, ops = _operands(m, len(sizes), n, k)
    bs = BlockSizesFp8(block_m=32, block_n=128 if style == "tpu" else 64)
    gs = jnp.asarray(sizes, jnp.int32)
    out = fp8_grouped_matmul(*ops, gs, out_dtype=jnp.float32, block_sizes=bs, backend=style,
                             interpret=True)
    want = numpy_grouped(*[np.asarray(o).astype(np.float32) for o in ops], sizes)
    assert out.shape == (m, n)
    assert np.abs(np.asarray(out) - want).max() / np.abs(want).max() < 1e-5
    assert np.all(np.asarray(out)[sum(sizes):] == 0)
    ref = fp8_grouped_matmul_reference(*ops, gs, out_dtype=jnp.float32)
    assert np.abs(np.asarray(ref) - want).max() / np.abs(want).max() < 1e-5
    starts = np.cumsum([0] + sizes)
    exact = np.zeros_like(want, dtype=np.float64)
    for gi in range(len(sizes)):
        exact[starts[gi]:starts[gi + 1]] = x[starts[gi]:starts[gi + 1]] @ w[gi].T.astype(np.float64)
    o = np.asarray(out, np.float64)
    assert 1 - 2 * np.sum(o * exact) / np.sum(o**2 + exact**2) < 1e-3


def test_fp8_grouped_matmul_errors():
    _, _, ops = _operands(16, 2, 128, 128)
    with pytest.raises(ValueError, match="group_sizes.shape"):
        fp8_grouped_matmul(*ops, jnp.array([16], jnp.int32), out_dtype=jnp.float32)


@pytest.mark.parametrize("style_,platform", LOWERINGS)
def test_fp8_grouped_matmul_lowers(style_, platform):
    _, _, ops = _operands(300, 4, 256, 384)
    f = functools.partial(fp8_grouped_matmul, out_dtype=jnp.bfloat16, backend=style_,
                          interpret=False)
    lowers(f, (*ops, jnp.array([100, 0, 150, 50], jnp.int32)), platform)

"""fp8_grouped_wgrad (each expert's weight gradient, contraction over its own tokens) against numpy."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (BlockSizesFp8, fp8_grouped_wgrad, fp8_grouped_wgrad_reference,
                            group_aligned_rows, quantize_1x128)
from pallas_test_utils import LOWERINGS, lowers, numpy_promoted_matmul


def _operands(sizes, k, n, seed=0):
    """Sorted rows x [M,K], dy [M,N]; their group-aligned, 128x1-quantised transposes."""
    rng = np.random.default_rng(seed)
    m = sum(sizes) + 5  # 5 rows past the groups: ignored
    x = rng.normal(size=(m, k)).astype(np.float32) * rng.uniform(0.1, 3, size=(m, 1))
    dy = rng.normal(size=(m, n)).astype(np.float32) * 0.1
    dest, tile_group = group_aligned_rows(jnp.asarray(sizes, jnp.int32), m)
    t = tile_group.shape[0] * 128

    def aligned_t(a):
        return quantize_1x128(jnp.zeros((t, a.shape[1])).at[dest].set(a, mode="drop").T)

    return x, dy, (*aligned_t(x), *aligned_t(dy), tile_group, jnp.asarray(sizes, jnp.int32))


def numpy_wgrad(sizes, lhs_q, lhs_s, rhs_q, rhs_s):
    """Each group's 128-token blocks start where the previous group's blocks end (aligned layout)."""
    out, block = [], 0
    for size in sizes:
        nb = -(-size // 128)
        toks, blks = slice(block * 128, (block + nb) * 128), slice(block, block + nb)
        out.append(numpy_promoted_matmul(lhs_q[:, toks], lhs_s[:, blks], rhs_q[:, toks], rhs_s[:, blks]))
        block += nb
    return np.stack(out)


CASES = [  # (group sizes, K, N): empty groups, a 1-row group, a group spanning 3 blocks
    ([37, 0, 1, 300], 200, 130),
    ([128, 129, 0], 128, 256),
]


@pytest.mark.parametrize("sizes,k,n", CASES)
def test_fp8_grouped_wgrad_matches_numpy(sizes, k, n, style):
    x, dy, ops = _operands(sizes, k, n)
    bs = BlockSizesFp8(block_m=64 if style == "triton" else 128, block_n=128)
    out = fp8_grouped_wgrad(*ops, block_sizes=bs, backend=style, interpret=True)
    want = numpy_wgrad(sizes, *[np.asarray(o).astype(np.float32) for o in ops[:4]])
    assert out.shape == (len(sizes), k, n) and out.dtype == jnp.float32
    assert np.abs(np.asarray(out) - want).max() / np.abs(want).max() < 1e-5
    ref = fp8_grouped_wgrad_reference(*ops)
    assert np.abs(np.asarray(ref) - want).max() / np.abs(want).max() < 1e-5
    starts = np.cumsum([0] + sizes)
    exact = np.stack([x[a:b].T.astype(np.float64) @ dy[a:b] for a, b in zip(starts[:-1], starts[1:])])
    assert np.all(np.asarray(out)[np.asarray(sizes) == 0] == 0)
    o = np.asarray(out, np.float64)
    assert 1 - 2 * np.sum(o * exact) / np.sum(o**2 + exact**2) < 1e-3


def test_fp8_grouped_wgrad_errors():
    _, _, ops = _operands([10, 20], 128, 128)
    with pytest.raises(ValueError, match="tile_group.shape"):
        fp8_grouped_wgrad(*ops[:4], ops[4][:-1], ops[5])
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_grouped_wgrad(ops[0][:, :100], ops[1], ops[2][:, :100], ops[3], ops[4], ops[5])


@pytest.mark.parametrize("style_,platform", LOWERINGS)
def test_fp8_grouped_wgrad_lowers(style_, platform):
    _, _, ops = _operands([100, 0, 150, 50], 384, 256)
    f = functools.partial(fp8_grouped_wgrad, out_dtype=jnp.float32, backend=style_, interpret=False)
    lowers(f, ops, platform)

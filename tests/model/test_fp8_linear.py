"""The FP8 linear's three GEMMs (Fprop, Dgrad, Wgrad; dense and grouped) against a numpy emulation.

The emulation quantises with numpy + ml_dtypes from the paper's rule (1x128 activation tiles,
128x128 weight blocks, 128x1 token tiles for Wgrad, scale = amax / 448) and promotes every
128-wide block of the contraction in fp32. Each GEMM is read off `jax.vjp` of the custom VJP,
through the jnp path (the default on CPU) and through the Pallas kernels in interpret mode.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from dsv3_jax.ops import linear

T = 128


def q_rows(a):
    """1x128 tiles along the last axis -> (e4m3 values as f32, scales [rows, ceil(K/128)])."""
    m, k = a.shape
    kb = -(-k // T)
    tiles = np.zeros((m, kb * T), np.float32)
    tiles[:, :k] = a
    tiles = tiles.reshape(m, kb, T)
    s = (np.maximum(np.abs(tiles).max(-1), 1e-4) / 448).astype(np.float32)
    q = (tiles / s[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q.reshape(m, kb * T)[:, :k], s


def q_blocks(w):
    """128x128 blocks -> (e4m3 values as f32, scales [ceil(N/128), ceil(K/128)])."""
    n, k = w.shape
    nb, kb = -(-n // T), -(-k // T)
    pad = np.zeros((nb * T, kb * T), np.float32)
    pad[:n, :k] = w
    blocks = pad.reshape(nb, T, kb, T)
    s = (np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-4) / 448).astype(np.float32)
    q = (blocks / s[:, None, :, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q.reshape(nb * T, kb * T)[:n, :k], s


def promoted(a_q, a_s, b_q, b_s, b_row_tile):
    """sum_kb (a[:, kb] @ b[:, kb].T) * a_s[:, kb] * b_s[row // b_row_tile, kb] in fp32."""
    out = np.zeros((a_q.shape[0], b_q.shape[0]), np.float32)
    rows = np.arange(b_q.shape[0]) // b_row_tile
    for kb in range(a_s.shape[1]):
        cols = slice(kb * T, (kb + 1) * T)
        out += (a_q[:, cols] @ b_q[:, cols].T) * a_s[:, kb:kb + 1] * b_s[rows, kb][None]
    return out


def numpy_linear(x, w, dy):
    """(y, dx, dw) of y = x @ w with the recipe's quantisation of every operand."""
    w_q, w_s = q_blocks(w.T)  # [N, K] blocks; Dgrad uses them transposed
    y = promoted(*q_rows(x), w_q, w_s, T)
    dx = promoted(*q_rows(dy), w_q.T, w_s.T, T)
    dw = promoted(*q_rows(x.T), *q_rows(dy.T), 1)
    return y, dx, dw


def calc_diff(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return 1 - 2 * np.sum(a * b) / np.sum(a * a + b * b)


def rel_max(got, want):
    return np.abs(np.asarray(got) - want).max() / np.abs(want).max()


@pytest.fixture(params=["jnp", "pallas"])
def kernels(request, monkeypatch):
    if request.param == "pallas":  # interpret mode on CPU
        for name, kernel in [("_matmul", pk.fp8_matmul), ("_grouped_matmul", pk.fp8_grouped_matmul),
                             ("_grouped_wgrad", pk.fp8_grouped_wgrad)]:
            monkeypatch.setattr(linear, name, kernel)
    return request.param


def _data(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(m, k)) * rng.uniform(0.1, 3, size=(m, 1))).astype(np.float32)
    w = (rng.normal(size=(k, n)) * 0.05).astype(np.float32)
    dy = (rng.normal(size=(m, n)) * rng.uniform(0.01, 1, size=(m, 1))).astype(np.float32)
    return x, w, dy


@pytest.mark.parametrize("m,k,n", [(200, 300, 130)])  # partial tiles on every axis
def test_dense_fprop_dgrad_wgrad(m, k, n, kernels):
    x, w, dy = _data(m, k, n)
    y, vjp = jax.vjp(lambda a, b: linear.fp8_matmul(a, b, None, jnp.float32), x, w)
    dx, dw = vjp(jnp.asarray(dy))
    for got, want, exact in zip((y, dx, dw), numpy_linear(x, w, dy), (x @ w, dy @ w.T, x.T @ dy)):
        assert rel_max(got, want) < 1e-5
        assert 0 < calc_diff(got, exact.astype(np.float64)) < 1e-3


def test_grouped_fprop_dgrad_wgrad(kernels):
    sizes = [37, 0, 1, 150, 20]  # an empty group, a 1-row group, a group over two token tiles
    m, k, n = sum(sizes) + 4, 256, 130  # 4 rows past the groups: zero output and gradients
    x, _, dy = _data(m, k, n, seed=1)
    w = (np.random.default_rng(2).normal(size=(len(sizes), k, n)) * 0.05).astype(np.float32)
    fn = lambda a, b: linear.fp8_matmul(a, b, jnp.asarray(sizes, jnp.int32), jnp.float32)  # noqa: E731
    y, vjp = jax.vjp(fn, x, w)
    dx, dw = vjp(jnp.asarray(dy))
    starts = np.cumsum([0] + sizes)
    for g, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        want_y, want_dx, want_dw = numpy_linear(x[a:b], w[g], dy[a:b]) if b > a else (0, 0, np.zeros((k, n)))
        if b > a:
            assert rel_max(y[a:b], want_y) < 1e-5 and rel_max(dx[a:b], want_dx) < 1e-5
            assert rel_max(dw[g], want_dw) < 1e-5
            assert calc_diff(dw[g], x[a:b].T @ dy[a:b]) < 1e-3
        else:
            assert np.all(np.asarray(dw[g]) == 0)
    assert np.all(np.asarray(y)[starts[-1]:] == 0) and np.all(np.asarray(dx)[starts[-1]:] == 0)
    exact_y = np.concatenate([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts[:-1], starts[1:]))])
    assert calc_diff(y[:starts[-1]], exact_y) < 1e-3


def test_gradients_follow_the_loss_scale(kernels):
    """Scaling dy by 2^-40 (the per-token gradients of a loss averaged over ~10^12 tokens) scales
    Dgrad and Wgrad by exactly 2^-40: every scale is its tile's own amax / 448, with no floor
    that turns small gradients into subnormals or zeros."""
    x, w, dy = _data(256, 256, 128, seed=3)
    _, vjp = jax.vjp(lambda a, b: linear.fp8_matmul(a, b, None, jnp.float32), x, w)
    c = 2.0 ** -40
    for got, want in zip(vjp(jnp.asarray(dy * c)), vjp(jnp.asarray(dy))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want) * c)


def test_backward_keeps_fp8_residuals_not_the_input():
    x, w, _ = _data(256, 256, 128)
    _, vjp = jax.vjp(lambda a, b: linear.fp8_matmul(a, b, None, jnp.bfloat16), x.astype(jnp.bfloat16), w)
    residuals = jax.tree.leaves(vjp)
    big = [r for r in residuals if r.size >= 128 * 128]
    assert big and all(r.dtype == jnp.float8_e4m3fn for r in big), [(r.shape, r.dtype) for r in residuals]
    # x as 128x1 token tiles [K, M] and w^T as 128x128 blocks [N, K]: one byte per element.
    assert sorted(r.shape for r in big) == [(128, 256), (256, 256)]

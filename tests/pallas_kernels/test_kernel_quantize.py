"""quantize_1x128 / quantize_128x128 against numpy written from the DeepSeek recipe."""

import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import (dequantize_1x128, dequantize_128x128, quantize_1x128,
                            quantize_128x128)


def _np_scale(amax, pow2):
    s = np.maximum(amax, 1e-4) / 448.0
    return np.exp2(np.ceil(np.log2(s))) if pow2 else s


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(5, 128), (3, 300), (1, 1)])
def test_quantize_1x128(shape, pow2):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32) * 3
    q, s = quantize_1x128(x, pow2_scale=pow2)
    kb = -(-shape[1] // 128)
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and s.shape == (shape[0], kb)
    for b in range(kb):
        tile = x[:, b * 128:(b + 1) * 128]
        want_s = _np_scale(np.abs(tile).max(axis=1), pow2).astype(np.float32)
        np.testing.assert_allclose(np.asarray(s[:, b]), want_s, rtol=1e-6)
        want_q = (tile / want_s[:, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(q[:, b * 128:(b + 1) * 128], np.float32), want_q)
    if pow2:
        assert np.all(np.log2(np.asarray(s)) == np.round(np.log2(np.asarray(s))))
    err = np.abs(np.asarray(dequantize_1x128(q, s)) - x).max()
    assert err <= np.abs(x).max() / 448 * 16 + 1e-6  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(256, 128), (200, 300), (576, 130)])
def test_quantize_128x128(shape, pow2):
    w = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    q, s = quantize_128x128(w, pow2_scale=pow2)
    nb, kb = -(-shape[0] // 128), -(-shape[1] // 128)
    assert s.shape == (nb, kb)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            np.testing.assert_allclose(float(s[i, j]), _np_scale(np.abs(blk).max(), pow2), rtol=1e-6)
    deq = np.asarray(dequantize_128x128(q, s))
    assert deq.shape == shape
    assert np.abs(deq - w).max() <= np.abs(w).max() / 448 * 16 * (2 if pow2 else 1)

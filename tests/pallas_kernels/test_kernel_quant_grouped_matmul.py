"""quant_grouped_matmul (int8 / int4 experts dequantised per tile) against the jnp path the model
runs (dsv3_jax/ops/dispatch.py with a QArray) and numpy, interpreted in both kernel styles; its
x-gradient (QLoRA over a frozen quantized base) against numpy's dy W^T."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.ops import dispatch, quant, tile_loop
from pallas_kernels.quant_grouped_matmul import (BlockSizes, quant_grouped_matmul,
                                                 quant_grouped_matmul_reference)
from pallas_test_utils import LOWERINGS, lowers
from tests.model.test_quant import np_dequantize

SIZES = [37, 0, 1, 50]  # an empty group, a one-row group, rows past the total (M = 100)


def _operands(fmt, m=100, k=128, n=160, group=32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(SIZES), k, n)) / k**0.5, jnp.float32)
    return x, quant.quantize(w, fmt, contract=1, stack=1, group=group)


def _jnp_path(x, qa):
    """The model's tile unit (tile_loop._tile_proj, a QArray expert dequantised per tile) on each
    group's rows: the jnp path the kernel stands in for."""
    out, start = np.zeros((x.shape[0], qa.shape[-1]), np.float32), 0
    for e, size in enumerate(SIZES):
        out[start:start + size] = np.asarray(tile_loop._tile_proj(x[start:start + size], qa[e]))
        start += size
    return out


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_kernel_matches_jnp_path_and_numpy(fmt, style):
    x, qa = _operands(fmt)
    bs = BlockSizes(block_m=32, block_n=128 if style == "tpu" else 64, block_k=64)
    kernel = functools.partial(quant_grouped_matmul, fmt=fmt, group=qa.group, block_sizes=bs, backend=style,
                               interpret=True)
    out, vjp = jax.vjp(lambda x: kernel(x, qa.q, qa.scale, jnp.asarray(SIZES, jnp.int32)), x)
    dy = np.random.default_rng(1).normal(size=out.shape)
    dx = vjp(jnp.asarray(dy, jnp.float32))[0]  # QLoRA's backward: dx through the frozen weights
    ref = quant_grouped_matmul_reference(x, qa.q, qa.scale, jnp.asarray(SIZES, jnp.int32), fmt=fmt, group=qa.group)
    jnp_path = _jnp_path(x, qa)
    want, want_dx, start = np.zeros_like(jnp_path), np.zeros(x.shape), 0
    for e, size in enumerate(SIZES):  # numpy on the independently decoded weights
        want[start:start + size] = np.asarray(x[start:start + size], np.float64) @ np_dequantize(qa)[e]
        want_dx[start:start + size] = dy[start:start + size] @ np_dequantize(qa)[e].T
        start += size
    assert out.shape == (100, 160)
    for got in (out, ref):
        np.testing.assert_allclose(np.asarray(got), jnp_path, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[sum(SIZES):] == 0)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)  # rows past the groups: 0


def test_kernel_errors_name_the_shape():
    x, qa = _operands("int4")
    with pytest.raises(ValueError, match="packed two per byte"):
        quant_grouped_matmul(x, qa.q[:, :32], qa.scale, jnp.asarray(SIZES, jnp.int32), fmt="int4", group=32)
    with pytest.raises(ValueError, match="group_sizes.shape"):
        quant_grouped_matmul(x, qa.q, qa.scale, jnp.asarray([100], jnp.int32), fmt="int4", group=32)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("style_,platform", LOWERINGS)
def test_kernel_lowers(fmt, style_, platform):
    x, qa = _operands(fmt, m=300, k=256, n=256, group=128)
    f = functools.partial(quant_grouped_matmul, fmt=fmt, group=128, backend=style_, interpret=False)
    args = (x.astype(jnp.bfloat16), qa.q, qa.scale, jnp.array([100, 0, 150, 50], jnp.int32))
    lowers(f, args, platform)
    lowers(jax.grad(lambda x, *w: jnp.sum(f(x, *w).astype(jnp.float32))), args, platform)  # QLoRA's backward


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_model_dispatch_through_the_kernel(fmt):
    """int experts on the ragged path (the Pallas kernel, interpreted on CPU) equal the tile loop."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(40, 64)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, 4, (40, 2)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(40, 2)), jnp.float32)
    ws = [quant.quantize(jnp.asarray(rng.normal(size=s) / s[1] ** 0.5, jnp.float32), fmt, contract=1, stack=1,
                         group=32) for s in ((4, 64, 32), (4, 64, 32), (4, 32, 64))]
    got = dispatch.routed_experts(x, experts, weights, *ws, impl="ragged")
    want = dispatch.routed_experts(x, experts, weights, *ws, impl="tiled")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

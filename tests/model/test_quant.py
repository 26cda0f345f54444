"""int8 / int4 weight-only quantization: the packing round-trips, the quantizer and every grouped
path (dense, tiled, ragged) and the dense projection equal numpy references written here from the
layout in dsv3_jax/ops/quant.py's docstring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.ops import dispatch, quant
from dsv3_jax.ops.linear import project
from tests.model.test_dispatch import _problem, numpy_moe

QMAX = {"int8": 127, "int4": 7}


def np_quantize(w_KxN, fmt, g):
    """Independent numpy: per (group of g rows, column) scale = amax / qmax, q = round-half-even(w / scale)."""
    k, n = w_KxN.shape[-2:]
    w = np.asarray(w_KxN, np.float64).reshape(*w_KxN.shape[:-2], k // g, g, n)
    scale = np.abs(w).max(axis=-2) / QMAX[fmt]
    q = np.clip(np.rint(w / scale[..., None, :]), -QMAX[fmt], QMAX[fmt]).reshape(w_KxN.shape)
    return q.astype(np.int64), scale


def np_unpack(packed, g):
    """Packed row i of a group: low nibble row i, high nibble row i + g/2 (two's complement)."""
    p = np.asarray(packed).astype(np.int64)
    lo, hi = p & 15, p >> 4
    lo, hi = np.where(lo > 7, lo - 16, lo), np.where(hi > 7, hi - 16, hi)
    *lead, kh, n = p.shape
    h = g // 2
    out = np.empty((*lead, kh // h, g, n), np.int64)
    out[..., :h, :] = lo.reshape(*lead, kh // h, h, n)
    out[..., h:, :] = hi.reshape(*lead, kh // h, h, n)
    return out.reshape(*lead, kh * 2, n)


def np_dequantize(qa):
    """The QArray's weight [*stack, K, N] in float64, from its arrays alone."""
    q = np_unpack(qa.q, qa.group) if qa.fmt == "int4" else np.asarray(qa.q).astype(np.int64)
    return q * np.repeat(np.asarray(qa.scale, np.float64), qa.group, axis=-2)


@pytest.mark.parametrize("xp", [np, jnp])
def test_int4_pack_round_trips_every_value(xp):
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, (3, 64, 5)).astype(np.int8)
    q[0, :16, 0] = np.arange(-8, 8)  # every nibble value
    packed = quant.pack_int4(xp.asarray(q), 32, xp=xp)
    assert packed.shape == (3, 32, 5) and packed.dtype == xp.uint8
    np.testing.assert_array_equal(np.asarray(quant.unpack_int4(packed, 32, xp=xp)), q)
    np.testing.assert_array_equal(np_unpack(packed, 32), q)  # the documented layout, decoded independently


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantize_equals_numpy(fmt):
    w = jax.random.normal(jax.random.key(1), (4, 64, 24))
    qa = quant.quantize(w, fmt, contract=1, stack=1, group=16)
    q_ref, s_ref = np_quantize(np.asarray(w), fmt, 16)
    got_q = np_unpack(qa.q, 16) if fmt == "int4" else np.asarray(qa.q)
    np.testing.assert_array_equal(got_q, q_ref)
    np.testing.assert_allclose(np.asarray(qa.scale), s_ref, rtol=1e-6)
    assert qa.shape == (4, 64, 24) and qa[2].shape == (64, 24)
    assert qa.nbytes == 4 * (64 * 24 * (1 if fmt == "int8" else 0.5) + 64 // 16 * 24 * 4)  # values + f32 scales


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("impl", ["dense", "tiled", "ragged"])
def test_grouped_paths_equal_numpy_of_quantized_weights(fmt, impl):
    x, experts, weights, w1, w3, w2 = _problem(37, 3, 8, d=32, f=16)
    qs = [quant.quantize(w, fmt, contract=1, stack=1, group=8) for w in (w1, w3, w2)]
    out = jax.jit(lambda x, e, w, *q: dispatch.routed_experts(x, e, w, *q, impl=impl))(x, experts, weights, *qs)
    want = numpy_moe(x, experts, weights, *(np_dequantize(q).astype(np.float32) for q in qs))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tiled_reads_a_quantized_layer_stack_in_place(fmt):
    x, experts, weights, w1, w3, w2 = _problem(21, 2, 4, d=16, f=16, seed=2)
    stacks = [jnp.stack([w, -w]) for w in (w1, w3, w2)]  # [L=2, E, ...]
    qs = [quant.quantize(s, fmt, contract=1, stack=2, group=8) for s in stacks]
    out = jax.jit(lambda l, *q: dispatch.routed_experts(x, experts, weights, *q, impl="tiled", layer=l))(1, *qs)
    want = numpy_moe(x, experts, weights, *(np_dequantize(q)[1].astype(np.float32) for q in qs))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_project_two_contracted_axes_equals_numpy(fmt):
    """wo-like [H, V, D]: K = H*V flattened, scales per group of the flattened rows."""
    x = jax.random.normal(jax.random.key(3), (2, 5, 4, 8))
    w = jax.random.normal(jax.random.key(4), (4, 8, 12))
    qa = quant.quantize(w, fmt, contract=2, group=16)
    got = project(x, qa, contract=2, compute_dtype=jnp.float32)
    want = np.asarray(x).reshape(10, 32) @ np_dequantize(qa)
    np.testing.assert_allclose(np.asarray(got).reshape(10, 12), want, rtol=1e-4, atol=1e-5)


def test_group_must_divide_contraction():
    with pytest.raises(ValueError, match="contraction size 48 is not a multiple"):
        quant.quantize(jnp.ones((48, 8)), "int8", contract=1, group=32, name="wq_b")
    with pytest.raises(ValueError, match="not a weight format"):
        quant.quantize(jnp.ones((48, 8)), "int3", contract=1)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_qlora_gradients_through_quantized_experts_equal_dense(fmt):
    """QLoRA's backward through a frozen quantized expert stack with per-expert adapters: dx and the
    six adapter gradients of `auto` (int: platform_dependent over the tile loop, run here, and the
    Pallas kernel, differentiated too; fp8: the FP8 grouped kernel's jnp twin) equal autodiff of the
    dense path over the dequantised fp32 weights. The FP8 kernels quantise x and dy in 1x128 tiles
    (DeepSeek-V3's recipe): within the fp8 bound there. The int kernel's own backward:
    tests/pallas_kernels/test_kernel_quant_grouped_matmul.py."""
    x, experts, weights, *ws = _problem(24, 2, 4, d=64, f=32, seed=3)
    qs = [quant.quantize(w, fmt, contract=1, stack=1, group=32) for w in ws]
    dense = [jnp.asarray(quant.dequantize(q), jnp.float32) for q in qs]
    shapes = [(4, 64, 4), (4, 4, 32), (4, 64, 4), (4, 4, 32), (4, 32, 4), (4, 4, 64)]
    adapters = [0.3 * jax.random.normal(jax.random.key(10 + i), s) for i, s in enumerate(shapes)]

    dy = jax.random.normal(jax.random.key(9), x.shape)

    def grads(impl, ws):
        def loss(x, *ad):
            return jnp.sum(dy * dispatch.routed_experts(x, experts, weights, *ws, *ad, impl=impl, lora_scale=2.0))
        return jax.jit(jax.grad(loss, range(7)))(x, *adapters)

    for got, ref in zip(grads("auto", qs), grads("dense", dense)):
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        if fmt == "fp8":
            assert 1 - 2 * np.sum(got * ref) / np.sum(got * got + ref * ref) < 2e-3  # as the fp8 forward's bound
        else:
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())

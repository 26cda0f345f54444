"""mla_decode (split-KV, absorbed MLA) against its reference, and the reference against numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockSizesMlaDecode, mla_decode, mla_decode_reference
from pallas_test_utils import LOWERINGS, lowers


def numpy_attention(q_lat, q_pe, kv, kp, lengths, scale):
    """Softmax attention written from the absorbed-MLA equations, float64, loop over rows."""
    b, h, r = q_lat.shape
    out, lse = np.zeros((b, h, r)), np.full((b, h), -np.inf)
    for i in range(b):
        n = int(lengths[i])
        if n == 0:
            continue
        s = (q_lat[i] @ kv[i, :n].T + q_pe[i] @ kp[i, :n].T) * scale
        mx = s.max(axis=1, keepdims=True)
        e = np.exp(s - mx)
        out[i] = (e / e.sum(axis=1, keepdims=True)) @ kv[i, :n]
        lse[i] = mx[:, 0] + np.log(e.sum(axis=1))
    return out, lse


def _inputs(b, h, r, p, s, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, h, r), (b, h, p), (b, s, r), (b, s, p)]
    return [jax.random.normal(k, sh, jnp.float32).astype(dtype) for k, sh in zip(ks, shapes)]


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()
                 / np.abs(np.asarray(b, np.float64)).max())


def test_reference_matches_numpy():
    args = _inputs(3, 4, 32, 8, 40, jnp.float32)
    lengths = np.array([1, 17, 40], np.int32)
    out, lse = mla_decode_reference(*args, jnp.asarray(lengths), softmax_scale=0.2, return_lse=True)
    want_out, want_lse = numpy_attention(*[np.asarray(a, np.float64) for a in args], lengths, 0.2)
    assert _rel(out, want_out) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5)


CASES = [  # (B, H, R, P, S, lengths, block_kv, num_splits)
    (3, 4, 64, 16, 300, [1, 130, 300], 128, 3),    # length 1, non-multiple, full; split 3 empty
    (2, 40, 128, 64, 512, [5, 257], 128, 4),       # most splits beyond the length; Triton: 4 head blocks
    (4, 2, 32, 8, 100, [0, 1, 99, 100], 128, 1),   # a zero-length row, single split
]


@pytest.mark.parametrize("case,dtype", [(CASES[0], jnp.float32), (CASES[0], jnp.bfloat16),
                                        (CASES[1], jnp.bfloat16), (CASES[2], jnp.float32)])
def test_mla_decode_matches_reference(case, dtype, style):
    b, h, r, p, s, lengths, block_kv, splits = case
    args = _inputs(b, h, r, p, s, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    bs = BlockSizesMlaDecode(block_kv=block_kv if style == "tpu" else 32, num_splits=splits)
    out, lse = mla_decode(*args, lengths, softmax_scale=0.125, return_lse=True, block_sizes=bs,
                          backend=style, interpret=True)
    ref, ref_lse = mla_decode_reference(*args, lengths, softmax_scale=0.125, return_lse=True)
    assert out.shape == (b, h, r) and out.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(out)))
    assert _rel(out, ref) < 2e-3
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5, rtol=0)
    empty = np.asarray(lengths) == 0
    assert np.all(np.asarray(out)[empty] == 0) and np.all(np.isneginf(np.asarray(lse)[empty]))


def test_mla_decode_default_path_and_errors():
    args = _inputs(2, 4, 32, 8, 64, jnp.bfloat16)
    out = mla_decode(*args, jnp.array([64, 3], jnp.int32), softmax_scale=0.1)
    ref = mla_decode_reference(*args, jnp.array([64, 3], jnp.int32), softmax_scale=0.1)
    assert _rel(out, ref) < 2e-3
    with pytest.raises(ValueError, match="lengths.shape"):
        mla_decode(*args, jnp.array([1], jnp.int32), softmax_scale=0.1)
    with pytest.raises(ValueError, match="block_kv=100 % 128 == 0"):
        mla_decode(*args, jnp.array([1, 2], jnp.int32), softmax_scale=0.1,
                   block_sizes=BlockSizesMlaDecode(block_kv=100), backend="tpu")


@pytest.mark.parametrize("style_,platform", LOWERINGS)
def test_mla_decode_lowers(style_, platform):
    """The 671B's heads; q_pe in fp32 beside a bf16 rope key, as the model hands them
    (`latent_attention._decode_operands`)."""
    args = _inputs(2, 128, 512, 64, 1000, jnp.bfloat16) + [jnp.array([1, 999], jnp.int32)]
    args[1] = args[1].astype(jnp.float32)
    f = functools.partial(mla_decode, softmax_scale=0.1, backend=style_, interpret=False)
    lowers(f, args, platform)


@pytest.mark.parametrize("r", [128, 160])
def test_fp8_cache_dequantised_per_block_equals_reference_on_dequantised_cache(r):
    """An e4m3 cache with 1x128 scales: the kernel's per-block dequantisation against numpy on the
    cache dequantised up front (the numbers the fp8 cache stands for)."""
    from pallas_kernels import quantize_1x128

    b, h, p, s = 2, 4, 16, 300
    q_lat, q_pe, kv, kp = _inputs(b, h, r, p, s, jnp.float32, seed=3)
    kv = kv * jnp.linspace(0.1, 20, r)  # scales that differ between the 128-value groups
    kv_q, kv_scale = quantize_1x128(kv.reshape(b * s, r))
    kv_q, kv_scale = kv_q.reshape(b, s, r), kv_scale.reshape(b, s, -1)
    kv_deq = np.asarray(kv_q, np.float64) * np.repeat(np.asarray(kv_scale, np.float64), 128, axis=-1)[..., :r]
    lengths = jnp.array([s, 137], jnp.int32)
    want, want_lse = numpy_attention(*(np.asarray(a, np.float64) for a in (q_lat, q_pe)), kv_deq,
                                     np.asarray(kp, np.float64), lengths, 0.05)
    got, lse = mla_decode(q_lat, q_pe, kv_q, kp, lengths, softmax_scale=0.05, return_lse=True, kv_scale=kv_scale,
                          block_sizes=BlockSizesMlaDecode(block_kv=128))
    assert _rel(got, want) < 1e-5 and _rel(lse, want_lse) < 1e-5
    assert _rel(mla_decode_reference(q_lat, q_pe, kv_q, kp, lengths, softmax_scale=0.05, kv_scale=kv_scale), want) < 1e-5
    with pytest.raises(ValueError, match="kv_scale"):
        mla_decode(q_lat, q_pe, kv_q, kp, lengths, softmax_scale=0.05, kv_scale=kv_scale[..., :0])

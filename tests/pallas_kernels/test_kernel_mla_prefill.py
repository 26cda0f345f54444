"""mla_prefill (causal, document-aware flash attention, Dqk != Dv) and its Pallas backward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockSizesMlaPrefill, mla_prefill, mla_prefill_reference
from pallas_test_utils import LOWERINGS, lowers
from tests.helpers import rel_err


def numpy_attention(q, k, v, scale, seg):
    """Causal, same-segment softmax attention in float64 with explicit loops over (b, h, t)."""
    b, t, h, _ = q.shape
    out = np.zeros((b, t, h, v.shape[3]))
    for bi in range(b):
        for hi in range(h):
            for ti in range(t):
                keys = [s for s in range(ti + 1) if seg[bi, s] == seg[bi, ti]]
                sc = np.array([q[bi, ti, hi] @ k[bi, s, hi] for s in keys]) * scale
                w = np.exp(sc - sc.max())
                out[bi, ti, hi] = (w / w.sum()) @ v[bi, keys, hi]
    return out


def _inputs(b, t, h, dk, dv, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype)
            for kk, d in zip(ks, (dk, dk, dv))]


def _segments(b, t, bounds):
    seg = np.zeros((b, t), np.int32)
    for i, start in enumerate(bounds):
        seg[:, start:] = i + 1
    return jnp.asarray(seg)



def test_reference_matches_numpy():
    q, k, v = _inputs(2, 12, 2, 6, 4, jnp.float32)
    seg = _segments(2, 12, [5, 9])
    got = mla_prefill_reference(q, k, v, softmax_scale=0.3, segment_ids=seg)
    want = numpy_attention(*[np.asarray(x, np.float64) for x in (q, k, v)], 0.3, np.asarray(seg))
    assert rel_err(got, want) < 1e-5
    causal = mla_prefill_reference(q, k, v, softmax_scale=0.3)
    want = numpy_attention(*[np.asarray(x, np.float64) for x in (q, k, v)], 0.3,
                           np.zeros((2, 12), np.int32))
    assert rel_err(causal, want) < 1e-5


CASES = [  # (T, Dqk, Dv, segment starts, dtype)
    (100, 48, 32, None, jnp.float32),        # T not a multiple of the block
    (64, 24, 16, [32], jnp.float32),          # causal diagonal on block edges; boundary at a block edge
    (90, 48, 32, [1, 37, 70], jnp.bfloat16),  # boundaries inside blocks, a 1-token document
]


def _blocks(style):
    return BlockSizesMlaPrefill(32, 128) if style == "tpu" else BlockSizesMlaPrefill(32, 32)


@pytest.mark.parametrize("style,case", [("tpu", CASES[0]), ("tpu", CASES[2]),
                                        ("triton", CASES[1]), ("triton", CASES[2])])
def test_mla_prefill_forward_and_grads(style, case):
    t, dk, dv, bounds, dtype = case
    q, k, v = _inputs(1, t, 2, dk, dv, dtype)
    seg = None if bounds is None else _segments(1, t, bounds)
    kw = dict(softmax_scale=dk ** -0.5, segment_ids=seg)
    f = lambda q, k, v: mla_prefill(q, k, v, block_sizes=_blocks(style), backend=style,
                                    interpret=True, **kw)
    r = lambda q, k, v: mla_prefill_reference(q, k, v, **kw)
    out, ref = f(q, k, v), r(q, k, v)
    assert out.shape == (1, t, 2, dv) and out.dtype == dtype
    tol = 2e-3 if dtype == jnp.float32 else 2e-2
    assert rel_err(out, ref) < tol
    ct = jax.random.normal(jax.random.key(7), out.shape, jnp.float32).astype(dtype)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct.astype(jnp.float32))
    grads = jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(r), argnums=(0, 1, 2))(q, k, v)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == rg.shape and g.dtype == rg.dtype
        assert rel_err(g, rg) < (2e-3 if dtype == jnp.float32 else 3e-2), name


def test_mla_prefill_default_path_and_errors():
    q, k, v = _inputs(2, 40, 2, 24, 16, jnp.float32)
    out = jax.jit(lambda q, k, v: mla_prefill(q, k, v, softmax_scale=0.2))(q, k, v)
    assert rel_err(out, mla_prefill_reference(q, k, v, softmax_scale=0.2)) < 2e-3
    with pytest.raises(ValueError, match="block_k=64 % 128 == 0"):
        mla_prefill(q, k, v, softmax_scale=0.2, backend="tpu",
                    block_sizes=BlockSizesMlaPrefill(block_q=64, block_k=64))
    with pytest.raises(ValueError, match="segment_ids.shape"):
        mla_prefill(q, k, v, softmax_scale=0.2, segment_ids=jnp.zeros((2, 3), jnp.int32))


@pytest.mark.parametrize("style_,platform", LOWERINGS)
def test_mla_prefill_lowers_with_backward(style_, platform):
    q, k, v = _inputs(1, 300, 2, 192, 128, jnp.bfloat16)
    seg = _segments(1, 300, [100])
    f = functools.partial(mla_prefill, softmax_scale=0.1, segment_ids=seg, backend=style_,
                          interpret=False)
    lowers(f, (q, k, v), platform)
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    lowers(grad, (q, k, v), platform)

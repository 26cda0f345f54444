"""ops.attention (probabilities recomputed in its backward) against numpy and plain autodiff."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.ops import attention as attn


def _problem(seed=0, b=2, t=9, h=3, k=5, v=4):
    ks = jax.random.split(jax.random.key(seed), 3)
    q, kk = (jax.random.normal(ks[i], (b, t, h, k)) for i in (0, 1))
    return q, kk, jax.random.normal(ks[2], (b, t, h, v)), jnp.array([[1] * 4 + [2] * 5, [1] * 6 + [0] * 3])


def numpy_attention(q, k, v, seg, scale):
    q, k, v, seg = map(np.asarray, (q, k, v, seg))
    t = q.shape[1]
    s = np.einsum("bthk,bshk->bhts", q, k) * scale
    visible = np.tril(np.ones((t, t), bool))[None, None] & (seg[:, None, :, None] == seg[:, None, None, :])
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshv->bthv", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("block", [4, 128])
@pytest.mark.parametrize("with_segments", [True, False])
def test_forward_equals_numpy(with_segments, block):
    """Query blocks of 4 rows over T = 9 (4, 4, then 1, each over the keys up to its last row) and
    one block over the whole call."""
    q, k, v, seg = _problem()
    seg = seg if with_segments else jnp.ones_like(seg)
    out = jax.jit(lambda *a: attn.attention(*a, softmax_scale=0.3, segment_ids=seg, block=block))(q, k, v)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, seg, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [4, 128])
def test_gradients_equal_plain_autodiff(block):
    q, k, v, seg = _problem(seed=1)
    w = jax.random.normal(jax.random.key(9), (2, 9, 3, 4))

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, softmax_scale=0.4, segment_ids=seg)) * w)

    ours = jax.jit(jax.grad(lambda *a: loss(functools.partial(attn.attention, block=block), *a), (0, 1, 2)))(q, k, v)
    ref = jax.grad(lambda *a: loss(attn.attention_reference, *a), (0, 1, 2))(q, k, v)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [4, 128])
def test_causal_attention_lse_in_query_blocks_equals_numpy(block):
    """Query blocks of 4 rows over T = 9 (4, 4, then 1: keys past each block skipped) and one block
    over the whole call give numpy's causal attention and its log-normaliser."""
    q, k, v, _ = _problem(seed=2)
    out, lse = jax.jit(lambda *a: attn.causal_attention_lse(*a, softmax_scale=0.3, block=block))(q, k, v)
    ones = np.ones(q.shape[:2], np.int32)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, ones, 0.3), rtol=1e-5, atol=1e-6)
    s = np.einsum("bthk,bshk->bhts", np.asarray(q), np.asarray(k)) * 0.3
    s = np.where(np.tril(np.ones((9, 9), bool)), s, -np.inf)
    want_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    np.testing.assert_allclose(lse, np.transpose(want_lse, (0, 2, 1)), rtol=1e-5, atol=1e-5)

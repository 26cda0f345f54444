"""The chunked head + cross-entropy (ops/head_loss.py) against numpy and against the whole logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.ops.head_loss import head_nll, head_nll_reference
from dsv3_jax.train import losses
from tests.helpers import shrunk_tiny_config

B, T, D, V = 2, 11, 6, 13  # T = 11: chunks of 4 leave a padded last chunk


def _case(seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(B, T, D)).astype(np.float32)
    w = (rng.normal(size=(D, V)) * 0.7).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    weights = ((rng.random((B, T)) > 0.3) * rng.uniform(0.5, 2.0, (B, T))).astype(np.float32)  # 0: not a target
    return h, w, targets, weights


def _numpy(h, w, targets, weights):
    """Loss and gradients from the paper's formula in float64: z = hW, nll = lse(z) - z[t]."""
    h, w, weights = h.astype(np.float64), w.astype(np.float64), weights.astype(np.float64)
    z = h @ w
    zmax = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - zmax).sum(-1)) + zmax[..., 0]
    nll = lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]
    dz = weights[..., None] * (np.exp(z - lse[..., None]) - np.eye(V)[targets])
    return (nll * weights).sum(), dz @ w.T, np.einsum("btd,btv->dv", h, dz), nll


@pytest.mark.parametrize("chunk", [1, 4, 11, 32])
def test_chunked_loss_and_gradients_equal_numpy(chunk):
    h, w, targets, weights = _case()
    want_loss, want_dh, want_dw, want_nll = _numpy(h, w, targets, weights)
    grad = jax.value_and_grad(lambda h, w, weights: head_nll(h, w, targets, weights, chunk=chunk), argnums=(0, 1, 2))
    for fn in (grad, jax.jit(grad)):
        loss, (dh, dw, dweights) = fn(h, w, weights)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        np.testing.assert_allclose(dh, want_dh, atol=1e-5)
        np.testing.assert_allclose(dw, want_dw, atol=1e-5)
        np.testing.assert_allclose(dweights, want_nll, atol=1e-5)  # d loss / d w_bt = nll_bt
    # A constant head (LoRA training) skips its gradient; d h stays the same.
    dh_only = jax.grad(lambda h: head_nll(h, w, targets, weights, chunk=chunk))
    for fn in (dh_only, jax.jit(dh_only)):
        np.testing.assert_allclose(fn(h), want_dh, atol=1e-5)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_both_layouts_of_the_chunk_loop_equal_numpy(vocab_major):
    """The loop a TPU/GPU lowering takes (W read as [D, V]) and the CPU one (a [V, D] copy for d h)."""
    from dsv3_jax.ops.head_loss import _scan_chunks

    h, w, targets, weights = _case(2)
    _, want_dh, want_dw, want_nll = _numpy(h, w, targets, weights)
    nll, dh, dw = jax.jit(lambda h, w: _scan_chunks(h, w, targets, weights, 4, jnp.float32, want_dh=True,
                                                    want_dw=True, vocab_major=vocab_major))(h, w)
    np.testing.assert_allclose(nll, want_nll, atol=1e-5)
    np.testing.assert_allclose(dh, want_dh, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, atol=1e-5)


def test_chunked_equals_the_whole_logits_under_a_scaled_cotangent():
    """Inside a larger function (a mean, a factor) the saved gradients are scaled by the cotangent."""
    h, w, targets, weights = _case(1)

    def outer(fn):
        return jax.grad(lambda h, w: 3.0 * fn(h, w, targets, weights, chunk=3) / weights.sum() + jnp.sum(h**2),
                        argnums=(0, 1))

    for got, want in zip(outer(head_nll)(h, w), outer(head_nll_reference)(h, w)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_chunk_must_be_positive():
    h, w, targets, weights = _case()
    with pytest.raises(ValueError, match="chunk=0"):
        head_nll(h, w, targets, weights, chunk=0)


@pytest.fixture(scope="module")
def mtp_model():
    cfg = shrunk_tiny_config(vocab_size=64, num_layers=3, num_mtp_layers=2, compute_dtype="float32")
    return DeepSeekV3(cfg, rngs=nnx.Rngs(5))


def test_training_losses_through_the_head_equal_the_logits_path(mtp_model):
    """Main and MTP cross-entropies and every parameter's gradient: Head(chunked) == Head(full) ==
    the logits the model returns, on a packed batch with padding (masked targets)."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(1, 64, (2, 14)).astype(np.int32)
    seg = np.array([[1] * 6 + [2] * 5 + [0] * 3, [1] * 10 + [0] * 4], np.int32)
    pos = np.concatenate([np.arange(6), np.arange(5), np.zeros(3)]).astype(np.int32)
    batch = {"tokens": tokens, "segment_ids": seg, "positions": np.stack([pos, np.arange(14) * (seg[1] > 0)])}
    graphdef, state = nnx.split(mtp_model)

    def loss(state, impl):
        m = nnx.merge(graphdef, state)
        inputs, _, _ = losses.inputs_and_targets(batch)
        t = inputs.shape[1]
        out = m.forward(inputs, positions=batch["positions"][:, :t], segment_ids=batch["segment_ids"][:, :t])
        head = None if impl is None else losses.Head(m.head[...], "float32", impl)
        parts = losses.training_losses(out, batch, mtp_weight=0.3, balance_weight=1e-4, head=head)
        return parts.total, parts

    results = {impl: jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(state, impl)
               for impl in (None, "full", "chunked")}
    (_, ref_parts), ref_grads = results[None]
    assert float(ref_parts.mtp) > 0
    for impl in ("full", "chunked"):
        (_, parts), grads = results[impl]
        np.testing.assert_allclose([parts.lm, parts.mtp], [ref_parts.lm, ref_parts.mtp], rtol=1e-5)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(got, want, atol=1e-5)

"""Targets, masks and losses against numpy; packing is document-aware (acceptance 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.train import losses
from tests.helpers import shrunk_tiny_config

# Two packed rows of T + 1 = 8 tokens: documents 1, 2 (+ padding) and 1 (+ padding).
TOKENS = np.array([[5, 6, 7, 8, 9, 10, 0, 0], [11, 12, 13, 14, 15, 0, 0, 0]], np.int32)
SEG = np.array([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]], np.int32)


def numpy_targets(tokens, seg, shift):
    b, n = tokens.shape
    t = n - 1
    targets, mask = np.zeros((b, t), np.int32), np.zeros((b, t), bool)
    for i in range(b):
        for j in range(t):
            if j + shift < n:
                targets[i, j] = tokens[i, j + shift]
                mask[i, j] = seg[i, j + shift] == seg[i, j] and seg[i, j] > 0
    return targets, mask


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_targets_and_masks_follow_documents(depth):
    inputs, targets, mask = losses.inputs_and_targets({"tokens": TOKENS, "segment_ids": SEG}, depth)
    want_targets, want_mask = numpy_targets(TOKENS, SEG, depth + 1)
    np.testing.assert_array_equal(inputs, TOKENS[:, :-1])
    np.testing.assert_array_equal(mask, want_mask)
    np.testing.assert_array_equal(np.where(want_mask, targets, 0), np.where(want_mask, want_targets, 0))
    if depth == 0:  # main head: document 1 predicts 6, 7 (not 8: document 2 starts there)
        assert mask[0].tolist() == [True, True, False, True, True, False, False]


def _mean_cross_entropy(logits, targets, mask):
    total, count = losses.cross_entropy(logits, targets, mask)
    return total / count


def test_cross_entropy_is_the_masked_mean_of_numpy_nll():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 7, 20)).astype(np.float32)
    targets = rng.integers(0, 20, (2, 7))
    mask = rng.random((2, 7)) > 0.3
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    want = (nll * mask).sum() / mask.sum()
    np.testing.assert_allclose(_mean_cross_entropy(logits, targets, mask), want, rtol=1e-5)



def test_cross_entropy_gradient_is_softmax_minus_onehot_in_numpy():
    """The one-pass backward of ops.cross_entropy against the closed form, under jit and without."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
    targets = rng.integers(0, 11, (3, 5))
    mask = rng.random((3, 5)) > 0.3
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = (probs - np.eye(11)[targets]) * mask[..., None] / mask.sum()
    grad = jax.grad(_mean_cross_entropy)
    for fn in (grad, jax.jit(grad)):
        np.testing.assert_allclose(fn(logits, targets, mask), want, rtol=1e-5, atol=1e-7)

@pytest.fixture(scope="module")
def model():
    cfg = shrunk_tiny_config(vocab_size=64, num_layers=3, num_mtp_layers=2)
    return DeepSeekV3(cfg, rngs=nnx.Rngs(3))


def loss_parts(model, batch):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, batch):
        m = nnx.merge(graphdef, state)
        inputs, _, _ = losses.inputs_and_targets(batch)
        t = inputs.shape[1]
        out = m.forward(inputs, positions=batch["positions"][:, :t], segment_ids=batch["segment_ids"][:, :t])
        return losses.training_losses(out, batch, mtp_weight=0.3, balance_weight=1e-4)

    return run(state, {k: jnp.asarray(v) for k, v in batch.items()})


def test_packed_batch_loss_equals_documents_run_separately(model):
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, 64, n).astype(np.int32) for n in (9, 6, 12)]
    n = 32  # T + 1

    def row(parts):
        tokens, seg, pos = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
        at = 0
        for i, d in enumerate(parts, 1):
            tokens[at:at + len(d)], seg[at:at + len(d)], pos[at:at + len(d)] = d, i, np.arange(len(d))
            at += len(d)
        return tokens, seg, pos

    def batch(rows):
        t, s, p = map(np.stack, zip(*rows))
        return {"tokens": t, "segment_ids": s, "positions": p}

    packed = loss_parts(model, batch([row(docs)]))
    separate = loss_parts(model, batch([row([d]) for d in docs]))
    # Same valid tokens, each seeing only its own document: equal means over all of them.
    np.testing.assert_allclose(packed.lm, separate.lm, rtol=2e-5)
    np.testing.assert_allclose(packed.mtp, separate.mtp, rtol=2e-5)
    # Control: without segment ids the packed documents attend to each other and the loss moves.
    unmasked = batch([row(docs)])
    unmasked["segment_ids"] = (unmasked["segment_ids"] > 0).astype(np.int32)
    assert abs(float(loss_parts(model, unmasked).lm) - float(packed.lm)) > 1e-3

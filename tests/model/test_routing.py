"""The router against a numpy transcription of docs/numerics.md (Router), and its properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.ops import routing


def numpy_router(logits, bias, top_k, groups, kept, scale):
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    b = s + bias
    n, e = b.shape
    per = e // groups
    chosen = np.zeros((n, top_k), np.int64)
    for i in range(n):
        gscore = np.array([np.sort(b[i, g * per:(g + 1) * per])[-2:].sum() for g in range(groups)])
        keep = np.argsort(-gscore, kind="stable")[:kept]
        masked = np.full(e, -np.inf)
        for g in keep:
            masked[g * per:(g + 1) * per] = b[i, g * per:(g + 1) * per]
        chosen[i] = np.argsort(-masked, kind="stable")[:top_k]
    w = np.take_along_axis(s, chosen, 1)
    return w / w.sum(1, keepdims=True) * scale, chosen


CASES = [(64, 16, 4, 4, 2), (40, 32, 8, 8, 3), (25, 12, 2, 3, 1), (30, 8, 3, 1, 1)]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("n, e, k, g, kept", CASES)
def test_matches_numpy_reference(n, e, k, g, kept, jit):
    rng = np.random.default_rng(n + e)
    logits = rng.normal(0, 2, (n, e)).astype(np.float32)
    # Negative biases push some biased scores below zero: excluded groups must be -inf, not 0.
    bias = rng.uniform(-1.2, 0.3, e).astype(np.float32)
    fn = lambda l, b: routing.route(l, b, top_k=k, num_groups=g, groups_kept=kept, routed_scale=2.5,
                                    normalize=True)
    out = (jax.jit(fn) if jit else fn)(logits, bias)
    w_ref, idx_ref = numpy_router(logits, bias, k, g, kept, 2.5)
    assert np.array_equal(np.sort(np.asarray(out.experts_NxK), 1), np.sort(idx_ref, 1))
    order = np.argsort(np.asarray(out.experts_NxK), 1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(out.weights_NxK), order, 1),
                               np.take_along_axis(w_ref, np.argsort(idx_ref, 1), 1), rtol=1e-6)


def test_zero_masking_would_differ():
    """A case where biased scores in kept groups are negative: 0-masking would pick an excluded group."""
    logits = np.full((1, 8), -6.0, np.float32)
    bias = np.array([-0.9, -0.9, -0.95, -0.95, -0.5, -0.5, -0.6, -0.6], np.float32)
    out = routing.route(logits, bias, top_k=2, num_groups=4, groups_kept=1, routed_scale=1.0, normalize=True)
    assert sorted(np.asarray(out.experts_NxK)[0].tolist()) == [4, 5]


def test_properties():
    rng = np.random.default_rng(0)
    e, g, kept, k = 32, 8, 3, 6
    out = routing.route(rng.normal(size=(200, e)).astype(np.float32), rng.normal(0, 0.3, e).astype(np.float32),
                        top_k=k, num_groups=g, groups_kept=kept, routed_scale=2.5, normalize=True)
    experts = np.asarray(out.experts_NxK)
    assert all(len(set(row)) == k for row in experts)  # k distinct experts
    assert all(len(set(row // (e // g))) <= kept for row in experts)  # within the kept groups
    np.testing.assert_allclose(np.asarray(out.weights_NxK).sum(1), 2.5, rtol=1e-6)  # sum to the routed scale


def test_bias_selects_but_does_not_gate():
    logits = np.zeros((1, 4), np.float32) + np.array([0.0, 1.0, 2.0, 3.0], np.float32)
    bias = np.array([10.0, 10.0, 0.0, 0.0], np.float32)
    out = routing.route(logits, bias, top_k=2, num_groups=1, groups_kept=1, routed_scale=1.0, normalize=False)
    assert sorted(np.asarray(out.experts_NxK)[0].tolist()) == [0, 1]
    s = 1 / (1 + np.exp(-np.array([0.0, 1.0])))
    np.testing.assert_allclose(np.sort(np.asarray(out.weights_NxK)[0]), np.sort(s), rtol=1e-6)
    grad = jax.grad(lambda b: routing.route(jnp.asarray(logits), b, top_k=2, num_groups=1, groups_kept=1,
                                            routed_scale=1.0, normalize=False).weights_NxK.sum())(bias)
    assert np.all(np.asarray(grad) == 0)  # the bias never receives gradient


def test_balance_loss_against_numpy():
    rng = np.random.default_rng(3)
    b, t, e, k = 3, 7, 8, 2
    logits = rng.normal(size=(b * t, e)).astype(np.float32)
    mask = rng.random((b, t)) > 0.2
    out = routing.route(logits, np.zeros(e, np.float32), top_k=k, num_groups=1, groups_kept=1, routed_scale=1.0,
                        normalize=True)
    got = float(routing.sequence_balance_loss(out, b, mask))
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    experts = np.asarray(out.experts_NxK).reshape(b, t, k)
    ref = []
    for i in range(b):
        valid = mask[i]
        count = np.zeros(e)
        for tok in np.nonzero(valid)[0]:
            count[experts[i, tok]] += 1
        f = e / (k * valid.sum()) * count
        sn = s.reshape(b, t, e)[i] / s.reshape(b, t, e)[i].sum(-1, keepdims=True)
        p = sn[valid].mean(0)
        ref.append((f * p).sum())
    np.testing.assert_allclose(got, np.mean(ref), rtol=1e-5)
    counts = routing.expert_counts(out.experts_NxK, e, jnp.asarray(mask.reshape(-1)))
    assert float(counts.sum()) == k * mask.sum()

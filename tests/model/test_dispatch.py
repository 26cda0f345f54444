"""Dropless dispatch: every expert-compute path equals numpy and the dense every-expert reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.ops import dispatch, padded_groups, tile_loop


def _problem(n, k, e, d=16, f=12, seed=0, skew=False):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (n, d))
    if skew == "one":  # every row on expert 0
        experts = jnp.zeros((n, k), jnp.int32)
    elif skew:  # most rows on two experts, several experts empty
        experts = jnp.stack([jax.random.randint(ks[1], (n,), 0, 2), jax.random.randint(ks[2], (n,), 2, 4)], 1)
        experts = experts[:, :k]
    else:
        experts = jnp.argsort(jax.random.uniform(ks[1], (n, e)), axis=1)[:, :k].astype(jnp.int32)
    weights = jax.random.uniform(ks[2], (n, k))
    w1, w3 = (jax.random.normal(ks[i], (e, d, f)) / d**0.5 for i in (3, 4))
    w2 = jax.random.normal(ks[5], (e, f, d)) / f**0.5
    return x, experts, weights, w1, w3, w2


def numpy_moe(x, experts, weights, w1, w3, w2):
    x, experts, weights = map(np.asarray, (x, experts, weights))
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        for j, ex in enumerate(experts[i]):
            g, u = x[i] @ np.asarray(w1[ex]), x[i] @ np.asarray(w3[ex])
            out[i] += weights[i, j] * ((g / (1 + np.exp(-g)) * u) @ np.asarray(w2[ex]))
    return out


@pytest.mark.parametrize("impl", ["dense", "tiled", "padded", "ragged"])
@pytest.mark.parametrize("n, k, e, skew", [(37, 3, 8, False), (5, 2, 16, False), (64, 2, 8, True), (1, 1, 4, False)])
def test_paths_equal_numpy(impl, n, k, e, skew):
    args = _problem(n, k, e, skew=skew)
    out = jax.jit(lambda *a: dispatch.routed_experts(*a, impl=impl))(*args)
    np.testing.assert_allclose(np.asarray(out), numpy_moe(*args), rtol=2e-5, atol=2e-5)


def _rows_past_c(experts, e) -> int:
    """Rows the padded groups leave to the tile loop: those past each expert's C."""
    c = padded_groups.rows_per_expert(experts.size, e)
    return int(np.sum(np.maximum(np.bincount(np.asarray(experts).ravel(), minlength=e) - c, 0)))


@pytest.mark.parametrize("impl, n, k, e, skew", [("tiled", 40, 3, 8, False), ("padded", 40, 3, 8, False),
                                                 ("padded", 40, 2, 8, True), ("padded", 128, 1, 4, "one"),
                                                 ("ragged", 40, 3, 8, False)])
def test_gradients_equal_dense(impl, n, k, e, skew):
    """`padded`, by how far the loads pass C: balanced, none; skewed, two experts far past it;
    every row on one expert, all but C through the tile loop."""
    args = _problem(n, k, e, seed=1, skew=skew)
    if impl == "padded":
        assert (_rows_past_c(args[1], e) > 0) == bool(skew)

    def loss(impl, x, w, w1, w3, w2):
        return jnp.sum(jnp.sin(dispatch.routed_experts(x, args[1], w, w1, w3, w2, impl=impl)))

    argnums = (1, 2, 3, 4, 5)
    ours = jax.grad(loss, argnums)(impl, args[0], *args[2:])
    ref = jax.grad(loss, argnums)("dense", args[0], *args[2:])
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_fp8_path_is_close_and_differentiable():
    """FP8 grouped kernel: within the recipe's bound of the full-precision experts; grads flow."""
    args = _problem(64, 2, 8, d=256, f=160, seed=2)
    full = dispatch.routed_experts(*args, impl="dense")
    quant = dispatch.routed_experts(*args, fp8=True)
    a, b = np.asarray(quant, np.float64), np.asarray(full, np.float64)
    assert 0 < 1 - 2 * np.sum(a * b) / np.sum(a * a + b * b) < 2e-3
    g = jax.grad(lambda w1: jnp.sum(dispatch.routed_experts(args[0], args[1], args[2], w1, *args[4:], fp8=True)))
    g_ref = jax.grad(lambda w1: jnp.sum(dispatch.routed_experts(args[0], args[1], args[2], w1, *args[4:], impl="dense")))
    ga, gb = np.asarray(g(args[3]), np.float64), np.asarray(g_ref(args[3]), np.float64)
    assert 1 - 2 * np.sum(ga * gb) / np.sum(ga * ga + gb * gb) < 1e-2


def test_sort_groups_rows_by_expert():
    experts = jnp.array([[3, 1], [0, 3], [1, 2]])
    rows = dispatch.sort_by_expert(experts, 5)
    assert np.asarray(rows.group_sizes_E).tolist() == [1, 2, 1, 2, 0]
    flat = np.asarray(experts).reshape(-1)
    expert_M, slot_M = tile_loop.expert_and_slot(rows.group_sizes_E, flat.size)
    assert np.array_equal(flat[np.asarray(rows.order_M)], np.asarray(expert_M))
    assert np.asarray(slot_M).tolist() == [0, 0, 1, 0, 0, 1]
    assert np.array_equal(np.asarray(rows.order_M) // 2, np.asarray(rows.token_M))


def test_tile_keeps_padding_bounded_by_activated_rows():
    for rows, experts in [(4096, 8), (4096, 64), (4096, 256), (100, 64)]:
        t = tile_loop.tile_rows(rows, experts, 128)
        assert experts * t <= max(rows, experts * 8)  # padding <= max(M, 8E) rows
        assert t & (t - 1) == 0 and 8 <= t <= 128


def test_auto_follows_the_platform_lowered_for():
    """`auto` is ragged_dot in a TPU or CUDA program and a CPU path in a CPU one, whatever the host."""
    args = _problem(32, 2, 4, d=16, f=8, seed=0)

    def text(platform):
        return jax.jit(lambda *a: dispatch.routed_experts(*a, impl="auto")).trace(*args).lower(
            lowering_platforms=(platform,)).as_text()

    assert "ragged_dot" in text("tpu") and "ragged_dot" in text("cuda") and "ragged_dot" not in text("cpu")

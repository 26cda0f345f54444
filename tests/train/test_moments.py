"""optimizer.moment_dtype: AdamW's moments stored in bf16 (the paper's FP8 recipe), numpy reference."""

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
import optax
import pytest

from dsv3_jax.train import optimizer

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.95, 1e-8, 0.1


def _opt(moment_dtype):
    return ml_collections.ConfigDict(dict(schedule="wsd", peak_lr=LR, end_lr=LR, warmup_steps=0, decay_fraction=0.0,
                                          b1=B1, b2=B2, eps=EPS, weight_decay=WD, clip_norm=1e9,
                                          moment_dtype=moment_dtype))


def numpy_adamw_bf16_moments(w, grads, decay):
    """Loshchilov & Hutter AdamW in fp32; the moments are rounded to bf16 after every step."""
    bf16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    mu, nu = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        mu_f, nu_f = B1 * mu + (1 - B1) * g, B2 * nu + (1 - B2) * g * g
        step = (mu_f / (1 - B1**t)) / (np.sqrt(nu_f / (1 - B2**t)) + EPS)
        w = w - LR * (step + (WD * w if decay else 0))
        mu, nu = bf16(mu_f), bf16(nu_f)
    return w, mu, nu


def adam_state(state) -> optax.ScaleByAdamState:
    found = jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
    return next(s for s in found if isinstance(s, optax.ScaleByAdamState))


def _run(moment_dtype, params, grads, mask):
    tx = optimizer.make_optimizer(_opt(moment_dtype), 10, mask)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads:
        updates, state = update(g, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params, state


def test_bf16_moments_match_numpy_and_halve_the_state():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(64, 48)).astype(np.float32), "g": rng.normal(size=(48,)).astype(np.float32)}
    mask = {"w": True, "g": False}
    grads = [{k: (rng.normal(size=v.shape) * 10.0 ** rng.uniform(-3, 0, size=v.shape)).astype(np.float32)
              for k, v in params.items()} for _ in range(4)]
    got, state = _run("bfloat16", params, grads, mask)
    adam = adam_state(state)
    for k in params:
        want_w, want_mu, want_nu = numpy_adamw_bf16_moments(params[k], [g[k] for g in grads], mask[k])
        assert adam.mu[k].dtype == jnp.bfloat16 and adam.nu[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(adam.mu[k], np.float32), want_mu)
        np.testing.assert_array_equal(np.asarray(adam.nu[k], np.float32), want_nu)
        np.testing.assert_allclose(got[k], want_w, rtol=2e-6, atol=1e-7)
        assert got[k].dtype == np.float32  # master weights stay fp32
    _, state32 = _run("float32", params, grads[:1], mask)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    moments = lambda s: (adam_state(s).mu, adam_state(s).nu)  # noqa: E731
    assert nbytes(moments(state)) * 2 == nbytes(moments(state32))


def test_float32_moments_are_optax_adamw():
    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(8, 8)).astype(np.float32)}
    grads = [{"w": rng.normal(size=(8, 8)).astype(np.float32)} for _ in range(3)]
    got, _ = _run("float32", params, grads, {"w": True})
    tx = optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    want, state, update = params, tx.init(params), jax.jit(tx.update)  # compiled as `_run` compiles ours
    for g in grads:
        u, state = update(g, state, want)
        want = optax.apply_updates(want, u)
    np.testing.assert_array_equal(got["w"], want["w"])


def test_unknown_moment_dtype_names_the_field():
    with pytest.raises(ValueError, match="optimizer.moment_dtype='float16'"):
        optimizer.make_optimizer(_opt("float16"), 10, {"w": True})

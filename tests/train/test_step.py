"""One jitted train step: the bias update rule, the skip guard, RNG and step counters."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.train import balancing, optimizer, state as state_lib, step as step_lib
from tests.helpers import shrunk_tiny_config

GAMMA = 0.01
CFG = shrunk_tiny_config(vocab_size=64, num_layers=3)
OPT = ml_collections.ConfigDict(dict(schedule="wsd", peak_lr=1e-2, end_lr=1e-3, warmup_steps=2, decay_fraction=0.5,
                                     b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0))


@pytest.fixture(scope="module")
def setup():
    model = DeepSeekV3(CFG, rngs=nnx.Rngs(0))
    _, params, _ = state_lib.split_model(model)
    tx = optimizer.make_optimizer(OPT, 10, optimizer.decay_mask(params))
    graphdef, state = state_lib.init_train_state(model, tx, seed=0)
    schedule = optimizer.make_schedule(OPT, 10)
    train_step = step_lib.make_train_step(graphdef, tx, schedule, mtp_weight=0.3, balance_weight=1e-4,
                                          bias_update_speed=GAMMA)
    return state, train_step, schedule


def make_batch(seed, b=4, n=17):
    rng = np.random.default_rng(seed)
    seg = np.ones((b, n), np.int32)
    seg[:, 12:] = 2
    seg[0, 14:] = 0  # padding at the end of row 0
    pos = np.where(seg == 2, np.arange(n) - 12, np.arange(n)).astype(np.int32) * (seg > 0)
    return {"tokens": rng.integers(3, 64, (b, n)).astype(np.int32), "segment_ids": seg, "positions": pos}


def test_router_bias_moves_by_gamma_sign_of_load_outside_the_optimizer(setup):
    state, train_step, schedule = setup
    batch = make_batch(0)
    bias_before = jax.tree.map(np.asarray, state.router_bias)
    new, metrics = train_step(state, batch)
    counts = {"moe_layers": np.asarray(metrics["expert_counts"]), "mtp": np.asarray(metrics["mtp_expert_counts"])}
    valid = int((batch["segment_ids"][:, :-1] > 0).sum())
    for name, bias in (("moe_layers", new.router_bias["moe_layers"]["ffn"]["gate"]["bias"]),
                       ("mtp", new.router_bias["mtp"]["block"]["ffn"]["gate"]["bias"])):
        c = counts[name]
        np.testing.assert_array_equal(c.sum(-1), valid * CFG.num_experts_per_token)  # padding not counted
        before = (bias_before["moe_layers"]["ffn"]["gate"]["bias"] if name == "moe_layers"
                  else bias_before["mtp"]["block"]["ffn"]["gate"]["bias"])
        want = before + GAMMA * np.sign(c.mean(-1, keepdims=True) - c)  # no decay, no Adam, no clipping
        np.testing.assert_allclose(np.asarray(bias), want, rtol=0, atol=1e-7)
    assert int(new.step) == 1 and int(new.skipped) == 0
    assert not np.array_equal(new.rng, state.rng)
    np.testing.assert_allclose(metrics["lr"], schedule(0), rtol=1e-6)


def test_non_finite_step_is_skipped_and_counted(setup):
    state, train_step, _ = setup
    poisoned = state.replace(params=jax.tree.map(lambda x: x, state.params))
    poisoned.params["head"] = poisoned.params["head"].at[0, 0].set(jnp.nan)
    new, metrics = train_step(poisoned, make_batch(1))
    assert not np.isfinite(float(metrics["loss"])) and int(metrics["skipped"]) == 1
    assert int(new.step) == 1 and int(new.skipped) == 1 and int(new.consecutive_skips) == 1
    for got, want in zip(jax.tree.leaves((new.params, new.opt_state, new.router_bias)),
                         jax.tree.leaves((poisoned.params, poisoned.opt_state, poisoned.router_bias))):
        np.testing.assert_array_equal(got, want)
    again, _ = train_step(new, make_batch(2))
    assert int(again.skipped) == 2 and int(again.consecutive_skips) == 2
    # A finite step resets the run of skips; the schedule follows applied updates only.
    healthy, metrics = train_step(state.replace(skipped=jnp.int32(2), consecutive_skips=jnp.int32(2),
                                                step=jnp.int32(2)), make_batch(3))
    assert int(healthy.consecutive_skips) == 0 and int(healthy.skipped) == 2 and int(metrics["skipped"]) == 0


def test_bias_update_and_maxvio_match_numpy():
    counts = np.array([[2.0, 2, 2, 2], [4, 2, 1, 1]])
    bias = np.array([[0.0, 0.1, -0.1, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(balancing.bias_update(bias, counts, 0.5),
                               [[0.0, 0.1, -0.1, 0], [-0.5, 0, 0.5, 0.5]])
    np.testing.assert_allclose(balancing.max_violation(counts), [0.0, 1.0])


def test_outer_layers_in_microbatches_give_the_whole_batch_step(setup):
    """outer_microbatches=2 (embedding, dense layers, head, MTP, loss over two slices of the batch in
    turn, each recomputed in the backward): the same losses, expert counts and updated state as the
    whole-batch step, on a batch whose halves hold different numbers of targets (padding in row 0)."""
    state, train_step, schedule = setup
    model = DeepSeekV3(CFG.replace(outer_microbatches=2), rngs=nnx.Rngs(0))
    _, params, _ = state_lib.split_model(model)
    graphdef = state_lib.split_model(model)[0]
    tx = optimizer.make_optimizer(OPT, 10, optimizer.decay_mask(params))
    micro_step = step_lib.make_train_step(graphdef, tx, schedule, mtp_weight=0.3, balance_weight=1e-4,
                                          bias_update_speed=GAMMA)
    batch = make_batch(1)
    want, want_metrics = train_step(state, batch)
    got, got_metrics = micro_step(state, batch)
    for key in ("loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "expert_counts", "mtp_expert_counts"):
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=2e-5, atol=1e-7, err_msg=key)
    # Adam's first update is lr * g / |g| per element: a near-zero gradient summed in another order
    # moves its element by up to ~1e-3 of lr, hence atol 1e-5 on the parameters (lr 1e-2)
    for g, w in zip(jax.tree.leaves((got.params, got.opt_state, got.router_bias)),
                    jax.tree.leaves((want.params, want.opt_state, want.router_bias))):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)

"""Schedules against the paper's piecewise definition; the decay mask; AdamW decay on matrices only."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from dsv3_jax import DeepSeekV3, ModelConfig
from dsv3_jax.model.params import RouterBias
from dsv3_jax.train import optimizer


def paper_lr(step, total, warmup, peak=2.2e-4, end=2.2e-5, final=7.3e-6):
    """DeepSeek-V3 section 4.2 with token counts turned into run fractions (14.8T tokens in all)."""
    tokens = (step / total) * 14.8
    if tokens < 10.0:
        lr = peak
    elif tokens < 14.3:
        lr = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (tokens - 10.0) / 4.3))
    elif tokens < 14.8 - 0.167:
        lr = end
    else:
        lr = final
    return lr * min(1.0, (step + 1) / warmup)


def test_deepseek_schedule_matches_the_paper():
    total, warmup = 14800, 200
    schedule = optimizer.deepseek_schedule(total, peak_lr=2.2e-4, end_lr=2.2e-5, final_lr=7.3e-6,
                                           warmup_steps=warmup)
    steps = [0, 99, 199, 5000, 9999, 10001, 12150, 14299, 14400, 14632, 14634, 14799]
    got = np.asarray(jax.vmap(schedule)(jnp.asarray(steps)))
    np.testing.assert_allclose(got, [paper_lr(s, total, warmup) for s in steps], rtol=1e-4)
    assert got[2] == np.float32(2.2e-4) and got[-1] == np.float32(7.3e-6)


def test_wsd_schedule():
    schedule = optimizer.wsd_schedule(100, peak_lr=1.0, end_lr=0.1, warmup_steps=10, decay_fraction=0.2)
    want = {0: 0.1, 9: 1.0, 50: 1.0, 80: 1.0, 90: 0.55, 100: 0.1}
    for step, lr in want.items():
        np.testing.assert_allclose(schedule(step), lr, rtol=1e-6)


def test_adamw_decays_matrices_only_and_never_sees_the_router_bias():
    model = DeepSeekV3(ModelConfig.tiny())
    params = nnx.state(model, nnx.Param)
    mask = optimizer.decay_mask(params)
    assert mask["embed"] and mask["head"] and mask["moe_layers"]["ffn"]["w1"]
    assert mask["moe_layers"]["ffn"]["gate"]["weight"] and mask["mtp"]["eh_proj"]
    assert not mask["norm"]["weight"] and not mask["moe_layers"]["attn_norm"]["weight"]
    assert not mask["moe_layers"]["attn"]["kv_norm"]["weight"]
    assert "bias" not in mask["moe_layers"]["ffn"]["gate"]  # RouterBias is not a parameter
    assert jax.tree.leaves(nnx.state(model, RouterBias))

    opt = ml_collections.ConfigDict(dict(schedule="wsd", peak_lr=0.5, end_lr=0.5, warmup_steps=0,
                                         decay_fraction=0.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                         clip_norm=1.0))
    tx = optimizer.make_optimizer(opt, 10, mask)
    pure = nnx.to_pure_dict(params)
    zero_grads = jax.tree.map(jnp.zeros_like, pure)
    updates, _ = jax.jit(tx.update)(zero_grads, tx.init(pure), pure)  # one dispatch, not one per leaf
    # With zero gradients only decoupled decay moves a weight: -lr * wd * w on matrices, 0 elsewhere.
    for (path, u), w, m in zip(jax.tree_util.tree_flatten_with_path(updates)[0], jax.tree.leaves(pure),
                               jax.tree.leaves(mask)):
        np.testing.assert_allclose(u, -0.5 * 0.1 * w if m else 0 * w, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_gradients_are_clipped_to_global_norm_one_before_adam():
    # b1 = b2 = 0 and eps = 1 make Adam's step g / (|g| + 1), so the clipped size shows through.
    opt = ml_collections.ConfigDict(dict(schedule="wsd", peak_lr=1.0, end_lr=1.0, warmup_steps=0,
                                         decay_fraction=0.0, b1=0.0, b2=0.0, eps=1.0, weight_decay=0.0,
                                         clip_norm=1.0))
    params = {"w": jnp.ones((3, 4))}
    tx = optimizer.make_optimizer(opt, 10, {"w": True})
    updates, _ = tx.update({"w": jnp.full((3, 4), 10.0)}, tx.init(params), params)
    g = 10.0 / math.sqrt(12 * 10.0**2)  # each entry after scaling the norm sqrt(12) * 10 down to 1
    np.testing.assert_allclose(updates["w"], np.full((3, 4), -g / (g + 1.0)), rtol=1e-5)

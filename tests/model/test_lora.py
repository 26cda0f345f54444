"""LoRA: merged weights give the adapter model's logits; expert adapters inside the grouped matmul
have the gradients of merged per-expert weights; the optimizer holds state for the adapters only."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.model import lora
from dsv3_jax.ops import dispatch
from dsv3_jax.train import optimizer, state as state_lib
from tests import helpers
from tests.model.test_dispatch import _problem

RANK = 4
CFG = helpers.shrunk_tiny_config(moe_impl="tiled")


def _randomize_b(model, seed=1):
    """B starts at zero (an adapted model starts as its base); give it values so the update shows."""
    for i, (path, v) in enumerate(nnx.iter_graph(model)):
        if isinstance(v, nnx.LoRAParam) and path[-1] == "b":
            v[...] = 0.3 * jax.random.normal(jax.random.key(seed + i), v.shape, v.dtype)


@nnx.jit
def _logits(model, tokens):
    return model.forward(tokens, with_mtp=False).logits


@pytest.fixture(scope="module")
def adapted():
    model = DeepSeekV3(CFG, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, CFG.vocab_size)
    base = _logits(model, tokens)
    lora.apply(model, lora.LoRAConfig(rank=RANK, experts=True))
    np.testing.assert_array_equal(_logits(model, tokens), base)  # B = 0: starts as the base
    _randomize_b(model)
    return model, tokens, base


def test_merge_equals_adapter_logits_and_unmerge_restores(adapted):
    model, tokens, base = adapted
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    with_adapters = _logits(model, tokens)
    assert helpers.rel_err(with_adapters, base) > 1e-2  # the adapters change the model
    taken = lora.merge(model)
    try:
        assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(model))
        np.testing.assert_allclose(_logits(model, tokens), with_adapters, atol=1e-5, rtol=0)
    finally:
        lora.unmerge(model, taken)
    after = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_allclose(np.asarray(after[k]), before[k], atol=1e-6)


def test_absorbed_form_uses_the_adapted_kv_b(adapted):
    """Prefill through the latent cache (absorbed MLA) gives the expanded form's logits."""
    from dsv3_jax.inference import cache as cache_lib

    model, tokens, _ = adapted
    cache = cache_lib.init_cache(model.config, tokens.shape[0], 16, "float32")
    positions = jnp.broadcast_to(jnp.arange(8), tokens.shape)
    cached = nnx.jit(lambda m, t, c: m.forward(t, cache=c, with_mtp=False, positions=positions).logits)(
        model, tokens, cache)
    np.testing.assert_allclose(cached, _logits(model, tokens), atol=2e-4)


def _expert_adapters(e, d, f, seed=3):
    ks = jax.random.split(jax.random.key(seed), 6)
    shapes = ((e, d, RANK), (e, RANK, f), (e, d, RANK), (e, RANK, f), (e, f, RANK), (e, RANK, d))
    return tuple(0.3 * jax.random.normal(k, s) for k, s in zip(ks, shapes))


@pytest.mark.parametrize("impl", ["dense", "tiled", "ragged"])
def test_expert_lora_gradients_equal_merged_reference(impl):
    """Each row meets its own expert's adapter: out and d/d(A, B, x) equal the dense dispatch over
    merged per-expert weights W_e + s A_e B_e (autodiff through the merge)."""
    x, experts, weights, w1, w3, w2 = _problem(40, 3, 8, seed=1)
    adapters = _expert_adapters(8, x.shape[1], w1.shape[-1])
    scale = 0.7

    def ours(x, *ad):
        y = dispatch.routed_experts(x, experts, weights, w1, w3, w2, *ad, impl=impl, lora_scale=scale, max_tile=8)
        return jnp.sum(jnp.sin(y))

    def merged(x, *ad):
        ws = [w + scale * jnp.einsum("EDr,ErF->EDF", ad[2 * i], ad[2 * i + 1]) for i, w in enumerate((w1, w3, w2))]
        return jnp.sum(jnp.sin(dispatch.routed_experts(x, experts, weights, *ws, impl="dense")))

    argnums = tuple(range(7))
    (y, got), (y_ref, want) = (jax.jit(jax.value_and_grad(f, argnums))(x, *adapters) for f in (ours, merged))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def _adapter_floats(cfg, r: int) -> int:
    """Trainable floats of rank-r LoRA on the default targets plus experts, from the config's
    dimensions: r * (fan_in + fan_out) per adapted matrix, once per layer and per expert."""
    d, h, q, c = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    k_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attn = (d + q) + (q + h * k_dim) + (d + c + cfg.qk_rope_head_dim) + (c + h * (cfg.qk_nope_head_dim + cfg.v_head_dim)) \
        + (h * cfg.v_head_dim + d)
    dense_mlp = 3 * (d + cfg.intermediate_size)
    shared = 3 * (d + cfg.moe_intermediate_size * cfg.num_shared_experts)
    routed = cfg.num_routed_experts * 3 * (d + cfg.moe_intermediate_size)
    return r * (cfg.num_layers * attn + cfg.num_dense_layers * dense_mlp + cfg.num_moe_layers * (shared + routed))


def test_optimizer_state_holds_only_the_adapters():
    model = DeepSeekV3(CFG, rngs=nnx.Rngs(0))
    lora.apply(model, lora.LoRAConfig(rank=RANK, experts=True))
    _, params, _ = state_lib.split_model(model)
    mask = optimizer.trainable_mask(params, nnx.LoRAParam)
    tx = optax.adamw(1e-3)
    _, state = state_lib.init_train_state(model, tx, 0, trainable=mask)
    moment_bytes = sum(a.nbytes for a in jax.tree.leaves(state.opt_state) if a.ndim > 0)
    assert moment_bytes == 2 * 4 * _adapter_floats(CFG, RANK)  # mu and nu, fp32
    trainable = sum(a.size for a in jax.tree.leaves(optimizer.select(state.params, mask)))
    assert trainable == _adapter_floats(CFG, RANK)

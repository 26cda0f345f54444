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


def test_dropout_masks_the_adapter_input_only():
    """project with dropout (rate, key) = numpy's x W + s ((x * m / (1 - rate)) A) B, m the op's
    Bernoulli mask: elements kept or zeroed, kept ones scaled, about `rate` of them zeroed; the
    base projection sees x whole. No dropout: x W + s (x A) B."""
    from dsv3_jax.ops import linear

    rate, s = 0.25, 2.0
    rng = np.random.default_rng(0)
    x, w, a, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((4, 64, 32), (32, 24), (32, 4), (4, 24)))
    key = jax.random.key_data(jax.random.key(7))
    dropped = np.asarray(linear.dropout(x, rate, key))
    m = dropped != 0
    np.testing.assert_allclose(dropped[m], x[m] / (1 - rate), rtol=1e-6)
    assert abs((~m).mean() - rate) < 0.02  # 8192 draws: 4 standard deviations of a Bernoulli(0.25) mean
    want = x @ w + s * ((x * m / (1 - rate)) @ a) @ b
    got = linear.project(x, w, contract=1, compute_dtype=jnp.float32, lora=(a, b, s, (rate, key)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for plain in ((a, b, s), (a, b, s, None)):
        np.testing.assert_allclose(linear.project(x, w, contract=1, compute_dtype=jnp.float32, lora=plain),
                                   x @ w + s * (x @ a) @ b, rtol=1e-5, atol=1e-4)
    other = np.asarray(linear.dropout(x, rate, jax.random.key_data(jax.random.key(8)))) != 0
    assert (other != m).mean() > 0.2  # another key, another mask


def _dropout_logits(model, tokens, keys):
    """Main-head logits with each key of `keys` (None: no dropout) given to a copy of the model."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def logits(state, key):  # as the train step: the state an argument, the model merged inside
        m = nnx.merge(graphdef, state)
        if key is not None:
            lora.with_dropout(m, key)
        return m.forward(tokens, with_mtp=False).logits

    return [np.asarray(logits(state, None if k is None else jax.random.key_data(jax.random.key(k)))) for k in keys]


def test_dropout_applies_with_a_step_key_only_and_dropout_0_is_none():
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, CFG.vocab_size)
    models = {}
    for rate in (0.0, 0.5):
        models[rate] = DeepSeekV3(CFG, rngs=nnx.Rngs(0))
        lora.apply(models[rate], lora.LoRAConfig(rank=RANK, dropout=rate))
        _randomize_b(models[rate])
    plain, plain_keyed = _dropout_logits(models[0.0], tokens, (None, 1))
    np.testing.assert_array_equal(plain_keyed, plain)  # dropout 0: a key changes nothing
    evaluated, k1, k1_again, k2 = _dropout_logits(models[0.5], tokens, (None, 1, 1, 2))
    np.testing.assert_array_equal(evaluated, plain)  # no key (eval, generate): the adapters whole
    assert helpers.rel_err(k1, plain) > 1e-3 and helpers.rel_err(k2, k1) > 1e-3
    np.testing.assert_array_equal(k1_again, k1)  # the masks are a function of the key

    keyed = nnx.merge(*nnx.split(models[0.5]))
    lora.with_dropout(keyed, jax.random.key_data(jax.random.key(1)))
    keys = [np.asarray(v[...]) for _, v in nnx.iter_graph(keyed) if isinstance(v, lora.DropoutKey)]
    assert len(keys) == 16  # every adapter: 5 MLA x 2 stacks, dense MLP 3, shared expert 3
    rows = np.concatenate([k.reshape(-1, 2) for k in keys])
    assert len({tuple(r) for r in rows}) == len(rows)  # one key per adapter and layer


def _numpy_expert_lora(x, experts, weights, ws, adapters, scale, masks, order):
    """Per (token, slot) in numpy: its expert's SwiGLU with each adapter's input multiplied by the
    mask row of its sorted position (`order`: sorted row -> flattened (token, slot))."""
    x, experts, weights, order = (np.asarray(v, np.float64) for v in (x, experts, weights, order))
    (w1, w3, w2), ad, (m1, m3, m2) = ([np.asarray(v, np.float64) for v in vs] for vs in (ws, adapters, masks))
    sorted_at = np.empty(len(order), int)
    sorted_at[order.astype(int)] = np.arange(len(order))
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e, r = int(experts[n, k]), sorted_at[n * experts.shape[1] + k]
            g = x[n] @ w1[e] + scale * ((x[n] * m1[r]) @ ad[0][e]) @ ad[1][e]
            u = x[n] @ w3[e] + scale * ((x[n] * m3[r]) @ ad[2][e]) @ ad[3][e]
            h = g / (1 + np.exp(-g)) * u
            out[n] += weights[n, k] * (h @ w2[e] + scale * ((h * m2[r]) @ ad[4][e]) @ ad[5][e])
    return out


@pytest.mark.parametrize("impl", ["dense", "tiled", "ragged"])
def test_expert_adapter_dropout_equals_numpy_per_expert(impl):
    """Routed-expert adapters with dropout: one mask row per sorted (token, expert) row, drawn from
    each adapter's key (`dispatch.adapter_masks`), entries 0 or 1 / (1 - rate); the output equals
    numpy's per-expert SwiGLU with those masks on the adapters' inputs only, and the gradients
    (x, A, B) of every path equal autodiff of the dense reference with the same masks."""
    x, experts, weights, w1, w3, w2 = _problem(40, 3, 8, seed=2)
    adapters = _expert_adapters(8, x.shape[1], w1.shape[-1], seed=4)
    rate, scale = 0.3, 0.7
    keys = [jax.random.key_data(jax.random.key(i)) for i in (11, 12, 13)]
    drop = (rate, *keys)
    rows = dispatch.sort_by_expert(experts, 8)
    masks = dispatch.adapter_masks(drop, 40 * 3, x.shape[1], w1.shape[-1], jnp.float32)
    m = np.concatenate([np.asarray(v).ravel() for v in masks])
    assert set(np.unique(m)) <= {0.0, np.float32(1 / (1 - rate))} and abs((m == 0).mean() - rate) < 0.03

    def run(impl, x, *ad):
        return dispatch.routed_experts(x, experts, weights, w1, w3, w2, *ad, impl=impl, lora_scale=scale,
                                       max_tile=8, lora_dropout=drop)

    want = _numpy_expert_lora(x, experts, weights, (w1, w3, w2), adapters, scale, masks, rows.order_M)
    np.testing.assert_allclose(np.asarray(jax.jit(run, static_argnums=0)(impl, x, *adapters)), want,
                               rtol=1e-4, atol=1e-4)
    no_drop = dispatch.routed_experts(x, experts, weights, w1, w3, w2, *adapters, impl=impl, lora_scale=scale,
                                      max_tile=8)
    assert helpers.rel_err(np.asarray(no_drop), want) > 1e-3  # the masks act

    def loss(impl, x, *ad):
        return jnp.sum(jnp.sin(run(impl, x, *ad)))

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(1, 8))), static_argnums=0)
    for g, r in zip(grad(impl, x, *adapters), grad("dense", x, *adapters)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_dropout_range_is_checked():
    with pytest.raises(ValueError, match=r"lora.dropout must lie in \[0, 1\)"):
        lora.LoRAConfig(dropout=1.0)

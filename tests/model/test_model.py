"""Whole-model properties: causality, document-aware packing, flat compile in depth, impl switches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3, ModelConfig

CFG = ModelConfig.tiny(initializer_range=0.2)


@pytest.fixture(scope="module")
def model():
    return DeepSeekV3(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward(model):
    return nnx.jit(lambda m, t, p, s: m.forward(t, positions=p, segment_ids=s))


def _tokens(b, t, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size, dtype=jnp.int32)


def test_shapes_and_stats(forward, model):
    out = forward(model, _tokens(2, 9), None, None)
    assert out.logits.shape == (2, 9, CFG.vocab_size) and out.logits.dtype == jnp.float32
    assert out.mtp_logits.shape == (1, 2, 9, CFG.vocab_size)
    assert out.router_stats.expert_counts.shape == (CFG.num_moe_layers, CFG.num_routed_experts)
    counts = np.asarray(out.router_stats.expert_counts)
    assert np.all(counts.sum(1) == 2 * 9 * CFG.num_experts_per_token)
    assert out.mtp_router_stats.expert_counts.shape == (1, CFG.num_routed_experts)
    assert np.all(np.asarray(out.router_stats.balance_loss) > 0)


def test_causal(forward, model):
    """Changing token j changes no logit before j (main head and every MTP depth)."""
    tokens = _tokens(1, 12)
    base = forward(model, tokens, None, None)
    j = 7
    changed = forward(model, tokens.at[0, j].set((tokens[0, j] + 1) % CFG.vocab_size), None, None)
    np.testing.assert_allclose(changed.logits[:, :j], base.logits[:, :j], atol=1e-5)
    assert not np.allclose(changed.logits[:, j], base.logits[:, j], atol=1e-3)
    # MTP depth k at i reads t_{i+k}: positions i < j - k are untouched.
    np.testing.assert_allclose(changed.mtp_logits[0, :, : j - 1], base.mtp_logits[0, :, : j - 1], atol=1e-5)


def test_gradient_causality(model):
    """d logits[t] / d embedding of tokens after t is zero (nanodo-style, through the whole stack)."""
    tokens = jnp.arange(10, dtype=jnp.int32)[None] + 3  # distinct ids, so embedding rows map to positions

    def logit_at(m, t):
        return m(tokens)[0, t].sum()

    grads = nnx.jit(nnx.grad(logit_at), static_argnums=1)(model, 4)
    row_norms = np.linalg.norm(np.asarray(grads.embed[...])[np.asarray(tokens[0])], axis=1)
    assert np.all(row_norms[:5] > 0) and np.all(row_norms[5:] == 0)


def test_packed_rows_equal_separate_documents(model, forward):
    a, b = _tokens(1, 5, seed=1), _tokens(1, 7, seed=2)
    packed = jnp.concatenate([a, b, jnp.zeros((1, 4), jnp.int32)], axis=1)
    seg = jnp.array([[1] * 5 + [2] * 7 + [0] * 4])
    pos = jnp.array([list(range(5)) + list(range(7)) + [0] * 4])
    out = forward(model, packed, pos, seg)
    ref_a = forward(model, a, jnp.arange(5)[None], None)
    ref_b = forward(model, b, jnp.arange(7)[None], None)
    np.testing.assert_allclose(out.logits[:, :5], ref_a.logits, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out.logits[:, 5:12], ref_b.logits, atol=2e-5, rtol=2e-5)
    # Padding tokens do not count as routed load.
    counts = np.asarray(out.router_stats.expert_counts).sum(1)
    assert np.all(counts == 12 * CFG.num_experts_per_token)


def _top_level_eqns(cfg):
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def f(state, tokens):
        return nnx.merge(graphdef, state).forward(tokens).logits

    return len(jax.make_jaxpr(f)(state, _tokens(1, 4)).jaxpr.eqns)


def test_program_size_is_flat_in_depth():
    assert _top_level_eqns(CFG.replace(num_layers=3)) == _top_level_eqns(CFG.replace(num_layers=12))


def _loss_and_grads(cfg, tokens):
    def loss(m):
        out = m.forward(tokens)
        return jnp.mean(out.logits**2) + jnp.mean(out.mtp_logits**2)

    return nnx.jit(nnx.value_and_grad(loss))(DeepSeekV3(cfg, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def tiled_loss_and_grads():
    return _loss_and_grads(CFG.replace(moe_impl="tiled"), _tokens(2, 8))


@pytest.mark.parametrize("overrides", [dict(moe_impl="dense"), dict(moe_impl="ragged"), dict(remat=True)])
def test_switches_do_not_change_numbers(overrides, tiled_loss_and_grads):
    ref_l, ref_g = tiled_loss_and_grads
    alt_l, alt_g = _loss_and_grads(CFG.replace(**overrides), _tokens(2, 8))
    np.testing.assert_allclose(alt_l, ref_l, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(alt_g), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bf16_compute_is_close_to_fp32(forward, model):
    tokens = _tokens(2, 8)
    bf16 = DeepSeekV3(CFG.replace(compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    ref, got = forward(model, tokens, None, None).logits, forward(bf16, tokens, None, None).logits
    assert got.dtype == jnp.float32
    p, q = jax.nn.log_softmax(ref), jax.nn.log_softmax(got)
    kl = float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), -1)))
    assert kl < 0.05


def test_bad_tokens_are_clear_errors(model):
    with pytest.raises(ValueError, match=r"vocab_size=512\); got 512 at \[batch=1, position=2\]"):
        model(jnp.zeros((2, 4), jnp.int32).at[1, 2].set(512))
    with pytest.raises(ValueError, match="got -1"):
        model(jnp.full((1, 3), -1, jnp.int32))
    with pytest.raises(ValueError, match="integer ids"):
        model(jnp.zeros((1, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"\[batch, length\]"):
        model(jnp.zeros((3,), jnp.int32))


def test_logical_axes_cover_every_variable(model):
    from dsv3_jax.model.params import logical_axes

    names = set()
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            axes = logical_axes(var)
            assert len(axes) == var.ndim, path
            names.update(a for a in axes if a)
            stacked = path[0] in ("dense_layers", "moe_layers", "mtp")
            assert (axes[0] == "layers") == stacked, path
    assert {"embed", "vocab", "heads", "q_lora", "kv_lora", "mlp", "expert", "layers"} <= names

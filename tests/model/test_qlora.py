"""QLoRA: LoRA over a base held quantized (int8 / int4 weight-only). The adapter model's logits and
adapter gradients equal a dense model built from the dequantized base with the update added in
numpy (the dense dispatch, autodiff: no quantized matmul, no LoRA branch, no tile-loop backward);
the base stays quantized and frozen, the optimizer holds state for the adapters alone; merge and
unmerge; fields that cannot go together are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.model import lora
from dsv3_jax.model import quant as model_quant
from dsv3_jax.ops.quant import QArray
from dsv3_jax.train import optimizer, state as state_lib
from tests import helpers
from tests.model.test_lora import _adapter_floats

RANK = 4
CFG = helpers.shrunk_tiny_config(moe_impl="tiled")  # quantized routed experts through the tile loop (CPU)
QLORA = lora.LoRAConfig(rank=RANK, experts=True, base_weights="int4", base_quantize="all")


def _adapter_paths(model):
    return {tuple(str(p) for p in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, lora.Adapter)}


def _qlora_model():
    """int4 base (every projection), adapters on the default targets and the routed experts, B
    drawn nonzero."""
    model = model_quant.quantize_model(DeepSeekV3(CFG, rngs=nnx.Rngs(0)), "int4", "all")
    lora.apply(model, QLORA)
    for i, (path, v) in enumerate(nnx.iter_graph(model)):
        if isinstance(v, nnx.LoRAParam) and path[-1] == "b":
            v[...] = 0.3 * jax.random.normal(jax.random.key(1 + i), v.shape, v.dtype)
    return model


def _dense_reference(model, *, merged: bool):
    """A dense fp32 model (dense dispatch) with `model`'s base dequantized. merged: W + s A B added
    in numpy, no adapters; else the same adapters left on, unmerged."""
    ref = model_quant.quantize_model(DeepSeekV3(CFG.replace(moe_impl="dense"), rngs=nnx.Rngs(0)), "int4", "all")
    model_quant.dequantize_model(ref, jnp.float32)
    nodes = {tuple(str(p) for p in path): node for path, node in nnx.iter_graph(ref)}
    for path, ad in _adapter_paths(model).items():
        owner, name = nodes[path[:-1]], path[-1].removesuffix("_lora")
        w = getattr(owner, name)
        a, b = np.asarray(ad.a[...], np.float64), np.asarray(ad.b[...], np.float64)
        batch = a.ndim + b.ndim - 2 - w.ndim
        lead, r = a.shape[:batch], a.shape[-1]
        delta = np.matmul(a.reshape(*lead, -1, r), b.reshape(*lead, r, -1)).reshape(w.shape)
        if merged:
            w[...] = jnp.asarray(np.asarray(w[...], np.float64) + ad.scale * delta, jnp.float32)
        else:
            setattr(owner, path[-1], nnx.clone(ad))
    return ref


def _logits(model, tokens):
    return nnx.jit(lambda m, t: m.forward(t, with_mtp=False).logits)(model, tokens)


@pytest.fixture(scope="module")
def qlora():
    return _qlora_model(), jax.random.randint(jax.random.key(0), (2, 8), 0, CFG.vocab_size)


def test_qlora_logits_equal_dequantized_base_plus_numpy_update(qlora):
    model, tokens = qlora
    assert all(isinstance(v[...], QArray) for _, v in nnx.iter_graph(model)
               if isinstance(v, model_quant.QuantizedWeight))
    adapters = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.LoRAParam)]
    assert len(adapters) == 2 * 19 and all(v.dtype == jnp.float32 for v in adapters)  # fp32 over an int4 base
    got, want = _logits(model, tokens), _logits(_dense_reference(model, merged=True), tokens)
    # Both comparisons differ by fp32 rounding only: merged x (W + BA) against unmerged xW + xAB, and
    # the int4 tile loop against the dense merged model (under 2e-5 with jax 0.10's XLA:CPU, up to
    # 2.1e-5 with 0.12's); adapters scaled 10% wrong move them by 0.7.
    assert helpers.rel_err(_logits(_dense_reference(model, merged=False), tokens), want) < 3e-5
    np.testing.assert_allclose(got, want, atol=3e-5 * np.abs(want).max(), rtol=0)


def test_qlora_adapter_gradients_equal_dense_reference(qlora):
    """d loss / d (A, B) through the quantized projections (their matmuls differentiated in x only)
    and the tile loop's backward over quantized experts (expert adapters included) = autodiff of
    the dequantized dense model with the same adapters."""
    model, tokens = qlora
    probe = jax.random.normal(jax.random.key(5), (*tokens.shape, CFG.vocab_size))

    def grads(m):
        graphdef, adapters, rest = nnx.split(m, nnx.LoRAParam, ...)

        @jax.jit
        def g(adapters, rest):  # as the train step: pure dicts in, the model merged inside the loss
            def loss(ad, rest):
                return jnp.sum(probe * nnx.merge(graphdef, ad, rest).forward(tokens, with_mtp=False).logits)
            return jax.grad(loss)(adapters, rest)
        flat = jax.tree_util.tree_flatten_with_path(g(nnx.to_pure_dict(adapters), nnx.to_pure_dict(rest)))[0]
        return {jax.tree_util.keystr(k): v for k, v in flat}

    got, want = grads(model), grads(_dense_reference(model, merged=False))
    assert got.keys() == want.keys() and len(got) == 2 * 19
    for k in want:
        w = np.asarray(want[k])
        np.testing.assert_allclose(np.asarray(got[k]), w, atol=1e-4 * max(np.abs(w).max(), 1e-3), rtol=0,
                                   err_msg=str(k))
    assert max(np.abs(np.asarray(v)).max() for v in got.values()) > 0


def test_qlora_optimizer_holds_the_adapters_and_the_base_stays_quantized():
    model = _qlora_model()
    _, params, _ = state_lib.split_model(model)
    mask = optimizer.trainable_mask(params, nnx.LoRAParam)
    _, state = state_lib.init_train_state(model, optax.adamw(1e-3), 0, trainable=mask)
    moment_bytes = sum(a.nbytes for a in jax.tree.leaves(state.opt_state) if a.ndim > 0)
    assert moment_bytes == 2 * 4 * _adapter_floats(CFG, RANK)  # mu and nu in fp32, adapters only
    adapter_bytes = sum(a.nbytes for a in jax.tree.leaves(optimizer.select(state.params, mask)))
    assert moment_bytes == 2 * adapter_bytes
    held = [v for v in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, QArray)) if isinstance(v, QArray)]
    assert len(held) == 5 * 3 + 3 + 3 * 2 + 3 * 2  # MLA (2 stacks, MTP), dense MLP, shared and routed (MoE, MTP)
    assert {v.q.dtype for v in held} == {np.dtype(np.uint8)}  # int4, two per byte


def test_qlora_merge_and_unmerge(qlora):
    model, tokens = qlora
    model = nnx.clone(model)
    with_adapters = _logits(model, tokens)
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, model_quant.QuantizedWeight))}
    taken = lora.merge(model)
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(model))
    still = [p for p, v in nnx.iter_graph(model) if isinstance(v, model_quant.QuantizedWeight)]
    assert len(still) == 30 - 19  # the 19 adapted weights merged; MTP's stay quantized
    np.testing.assert_allclose(_logits(model, tokens), with_adapters, atol=2e-5 * np.abs(with_adapters).max(), rtol=0)
    lora.unmerge(model, taken)
    after = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, model_quant.QuantizedWeight))}
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])  # the quantized base back bit for bit
    np.testing.assert_array_equal(_logits(model, tokens), with_adapters)


def test_qlora_fields_are_checked():
    with pytest.raises(ValueError, match="lora.base_weights='int3'"):
        lora.LoRAConfig(base_weights="int3")
    with pytest.raises(ValueError, match="lora.base_quantize='mla'"):
        lora.LoRAConfig(base_weights="int4", base_quantize="mla")

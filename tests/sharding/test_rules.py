"""Mesh sizes, the rules table and every parameter's sharding (issue acceptance 2).

Specs are checked on abstract meshes (no devices needed); the per-device byte count is checked on
8 fake CPU devices in a subprocess.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import sharding
from tests import helpers
from dsv3_jax import DeepSeekV3, ModelConfig
from dsv3_jax.train import sharded, state as state_lib



def test_resolve_sizes_fills_minus_one_and_defaults_to_one():
    assert sharding.resolve_sizes({"data": 2, "expert": -1}, 8) == {
        "pipeline": 1, "data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    assert sharding.resolve_sizes({}, 1)["data"] == 1


@pytest.mark.parametrize("sizes, devices, message", [
    ({"data": 3}, 8, "needs 3 devices but 8 are available"),
    ({"data": 3, "fsdp": -1}, 8, "do not divide the 8 devices"),
    ({"data": -1, "fsdp": -1}, 8, "only one mesh axis may be -1"),
    ({"model": 8}, 8, "unknown mesh axes ['model']"),
    ({"data": 0}, 8, "must be positive"),
])
def test_resolve_sizes_errors(sizes, devices, message):
    with pytest.raises(sharding.MeshError, match=message.replace("[", r"\[").replace("]", r"\]")):
        sharding.resolve_sizes(sizes, devices)


def test_check_divides_names_the_quantity_and_axes():
    mesh = sharding.abstract_mesh({"data": 2, "expert": 4}, 8)
    sharding.check_divides("data.batch_size", 16, mesh, ("data", "fsdp", "expert"))
    with pytest.raises(sharding.MeshError, match=r"data.batch_size=12 is not divisible by data=2 x fsdp=1 x "
                                                 r"expert=4 \(8 shards\)"):
        sharding.check_divides("data.batch_size", 12, mesh, ("data", "fsdp", "expert"))
    with pytest.raises(sharding.MeshError, match="num_routed_experts=6"):
        sharding.check_divides("num_routed_experts", 6, mesh, ("expert",))


def test_spec_fallback_strict_and_axis_used_once():
    mesh = sharding.abstract_mesh({"pipeline": 2, "fsdp": 2, "tensor": 2}, 8)
    rules = sharding.get_rules("default")
    # 3 layers on pipeline=2: not split along layers (documented fallback; the embed dimension takes
    # `pipeline` instead); strict names it.
    assert sharding.logical_to_spec(("layers", "embed"), (3, 8), mesh, rules) == P(None, ("fsdp", "pipeline"))
    assert sharding.logical_to_spec(("layers", "embed"), (4, 8), mesh, rules) == P("pipeline", "fsdp")
    with pytest.raises(sharding.ShardingRuleError, match=r"w: dimension 0 \('layers', size 3\) cannot be sharded "
                                                         r"on mesh axis 'pipeline' of size 2"):
        sharding.logical_to_spec(("layers", "embed"), (3, 8), mesh, rules, strict=True, name="w")
    # embed and q_lora both map to (fsdp, pipeline): the first dimension keeps them.
    assert sharding.logical_to_spec(("embed", "q_lora"), (8, 8), mesh, rules) == P(("fsdp", "pipeline"), None)
    # a tuple rule shards over the product, dropping axes that do not divide.
    mesh2 = sharding.abstract_mesh({"data": 2, "fsdp": 2, "expert": 2}, 8)
    assert sharding.logical_to_spec(("batch", None), (8, 5), mesh2, rules) == P(("data", "fsdp", "expert"), None)
    assert sharding.logical_to_spec(("batch", None), (4, 5), mesh2, rules) == P(("data", "fsdp"), None)
    with pytest.raises(sharding.ShardingRuleError, match="logical axis 'rows' has no rule"):
        sharding.logical_to_spec(("rows",), (4,), mesh2, rules)
    with pytest.raises(sharding.ShardingRuleError, match="unknown sharding preset 'zero9'"):
        sharding.get_rules("zero9")


def _abstract_params(cfg):
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    _, params, biases = state_lib.split_model(model)
    return params, biases


# Every parameter of the tiny model (stack prefixes dropped: dense_layers / moe_layers / mtp.block
# share a layout) on mesh (fsdp=2, tensor=2, expert=2, pipeline=1) under the default rules.
EXPECTED_DEFAULT = {
    "embed": P("tensor", "fsdp"),
    "head": P("fsdp", "tensor"),
    "norm/weight": P("fsdp"),
    "attn/wq_a": P(None, "fsdp", None),
    "attn/q_norm/weight": P(None, "fsdp"),
    "attn/wq_b": P(None, "fsdp", "tensor", None),
    "attn/wkv_a": P(None, "fsdp", None),
    "attn/kv_norm/weight": P(None, "fsdp"),
    "attn/wkv_b": P(None, "fsdp", "tensor", None),
    "attn/wo": P(None, "tensor", None, "fsdp"),
    "attn_norm/weight": P(None, "fsdp"),
    "ffn_norm/weight": P(None, "fsdp"),
    "ffn/w1": P(None, "fsdp", "tensor"),  # dense MLP and shared expert: [L, D, F]
    "ffn/w3": P(None, "fsdp", "tensor"),
    "ffn/w2": P(None, "tensor", "fsdp"),
    "ffn/shared_experts/w1": P(None, "fsdp", "tensor"),
    "ffn/shared_experts/w3": P(None, "fsdp", "tensor"),
    "ffn/shared_experts/w2": P(None, "tensor", "fsdp"),
    "moe:ffn/w1": P(None, "expert", "fsdp", "tensor"),  # routed experts: [L, E, D, F]
    "moe:ffn/w3": P(None, "expert", "fsdp", "tensor"),
    "moe:ffn/w2": P(None, "expert", "tensor", "fsdp"),
    "ffn/gate/weight": P(None, "expert", "fsdp"),
    "ffn/gate/bias": P(None, "expert"),
    "eh_proj": P(None, None, "fsdp"),
    "enorm/weight": P(None, "fsdp"),
    "hnorm/weight": P(None, "fsdp"),
    "mtp_norm/weight": P(None, "fsdp"),
}


def _kind(path):
    keys = list(path)
    prefix = keys[0]
    if prefix in ("dense_layers", "moe_layers"):
        keys = keys[1:]
    elif prefix == "mtp":
        keys = keys[2:] if keys[1] == "block" else keys[1:]
        if keys == ["norm", "weight"]:
            return "mtp_norm/weight"
    kind = "/".join(keys)
    routed = kind in ("ffn/w1", "ffn/w2", "ffn/w3") and prefix != "dense_layers"
    return ("moe:" + kind) if routed else kind


def test_every_parameter_sharding_is_what_the_rules_say():
    cfg = ModelConfig.tiny()
    params, biases = _abstract_params(cfg)
    mesh = sharding.abstract_mesh({"fsdp": 2, "tensor": 2, "expert": 2}, 8)
    rules = sharding.get_rules("default")
    seen = set()
    for variables in (params, biases):
        for path, (shape, sh) in sharded.variable_shardings(variables, mesh, rules, strict=True).items():
            kind = _kind(path)
            assert kind in EXPECTED_DEFAULT, f"parameter {path} is not listed"
            assert sh.spec == EXPECTED_DEFAULT[kind], (path, shape, sh.spec)
            seen.add(kind)
    assert seen == set(EXPECTED_DEFAULT)


@pytest.mark.parametrize("preset, mesh_sizes, routed_w1, wq_b, embed", [
    ("fsdp", {"fsdp": 8}, P(None, None, "fsdp", None), P(None, "fsdp", None, None), P("fsdp", None)),
    ("fsdp_expert", {"fsdp": 2, "expert": 4}, P(None, "expert", "fsdp", None), P(None, "fsdp", None, None),
     P("fsdp", None)),
    ("expert_tensor", {"expert": 4, "tensor": 2}, P(None, "expert", None, "tensor"), P(None, None, "tensor", None),
     P("tensor", None)),
    # the embedding has no layer axis: it takes `pipeline` on its embed dimension (ZeRO-style fallback)
    ("pipeline_expert_data", {"pipeline": 2, "expert": 2, "data": 2}, P("pipeline", "expert", None, None),
     P("pipeline", None, None, None), P(None, "pipeline")),
])
def test_presets(preset, mesh_sizes, routed_w1, wq_b, embed):
    cfg = ModelConfig.tiny().replace(num_layers=5, num_heads=4)  # 4 MoE layers: pipeline=2 divides them
    params, _ = _abstract_params(cfg)
    mesh = sharding.abstract_mesh(mesh_sizes, 8)
    flat = sharded.variable_shardings(params, mesh, sharding.get_rules(preset))
    assert flat[("moe_layers", "ffn", "w1")][1].spec == routed_w1
    assert flat[("moe_layers", "attn", "wq_b")][1].spec == wq_b
    assert flat[("embed",)][1].spec == embed


@pytest.mark.parametrize("preset", ["default", "pipeline_expert_data"])
def test_layers_the_stages_do_not_divide_shard_pipeline_elsewhere(preset):
    """3 MoE layers on pipeline=2: the layer axis cannot take `pipeline`, so the experts (and, under
    the default rules, the embed / LoRA dimensions) take it: no parameter is whole on every stage
    unless it is too small to split."""
    cfg = ModelConfig.tiny().replace(num_layers=4)
    params, _ = _abstract_params(cfg)
    mesh = sharding.abstract_mesh({"pipeline": 2, "expert": 2, "data": 2}, 8)
    flat = sharded.variable_shardings(params, mesh, sharding.get_rules(preset))
    assert flat[("moe_layers", "ffn", "w1")][1].spec == P(None, ("expert", "pipeline"), None, None)
    assert flat[("moe_layers", "attn", "wq_a")][1].spec[:2] == (None, "pipeline")
    uses_pipeline = [k for k, (_, sh) in flat.items() if any("pipeline" in ((e,) if isinstance(e, str) else e or ())
                                                             for e in sh.spec)]
    big = [k for k, (shape, _) in flat.items() if np.prod(shape) >= 1024]
    assert set(big) <= set(uses_pipeline), sorted(set(big) - set(uses_pipeline))


def test_per_device_bytes_on_eight_devices():
    """Placed parameters hold total / shards bytes per device on each sharded parameter."""
    out = helpers.run_module("tests.sharding.bytes_worker", env=helpers.fake_device_env(8), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    for row in report["params"]:
        assert row["device_bytes"] * row["shards"] == row["total_bytes"], row
    assert report["sharded_params"] >= 40
    assert report["device_total"] == report["expected_device_total"]
    assert report["device_total"] < report["total"] / 4  # (fsdp=2, tensor=2, expert=2): most bytes split 8 ways


def test_adam_moments_are_split_over_data_zero_1():
    """ZeRO-1: on data=2 x expert=4 the AdamW moments take their parameter's spec plus `data`, even
    where the parameter is replicated over `data`; each device's slice of a moment is half its
    slice of the parameter (counted from the shard shapes), and the counters stay replicated."""
    import optax

    cfg = ModelConfig.tiny()
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    _, state = state_lib.abstract_train_state(model, optax.adam(1e-3), 0)
    mesh = sharding.abstract_mesh({"data": 2, "expert": 4}, 8)
    shardings = sharded.train_state_shardings(model, state, mesh)
    mu, nu = state.opt_state[0].mu, state.opt_state[0].nu
    for moments, moment_shardings in ((mu, shardings.opt_state[0].mu), (nu, shardings.opt_state[0].nu)):
        for leaf, sh, param_sh in zip(jax.tree.leaves(moments), jax.tree.leaves(moment_shardings),
                                      jax.tree.leaves(shardings.params)):
            assert not any("data" in ((e,) if isinstance(e, str) else e or ()) for e in param_sh.spec)
            assert any("data" in ((e,) if isinstance(e, str) else e or ()) for e in sh.spec), sh.spec
            assert np.prod(sh.shard_shape(leaf.shape)) * 2 == np.prod(param_sh.shard_shape(leaf.shape))
    assert shardings.opt_state[0].count.spec == P()


@pytest.mark.parametrize("preset, mesh_sizes", [("default", {"fsdp": 8}), ("default", {"fsdp": 2, "expert": 4}),
                                                ("expert_tensor", {"expert": 4, "tensor": 2})])
def test_scan_body_pins_each_layer_to_its_slice_of_the_stack_sharding(preset, mesh_sizes):
    """Inside a layer scan, `layer_constraint` pins every weight of the layer to the spec the rules
    give its stack, less the layer axis (so XLA gathers one layer at a time), and does nothing
    without rules."""
    import jax
    from dsv3_jax.model import params as params_lib

    cfg = ModelConfig.tiny().replace(num_layers=5)
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    graphdef, stacked = nnx.split(model.moe_layers)
    mesh = sharding.abstract_mesh(mesh_sizes, 8)
    _, params, biases = state_lib.split_model(model)
    want = sorted(str(P(*sh.spec[1:])) for variables in (params, biases)
                  for path, (_, sh) in sharded.variable_shardings(variables, mesh, sharding.get_rules(preset)).items()
                  if path[0] == "moe_layers")

    def pinned():
        def first_layer(stack_state):  # a new function each time: jax's trace cache does not see the rules
            layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stack_state))
            return nnx.split(params_lib.layer_constraint(model.moe_layers)(layer))[1]

        jaxpr = jax.make_jaxpr(first_layer)(stacked)
        return sorted(str(e.params["sharding"].spec) for e in jaxpr.eqns if e.primitive.name == "sharding_constraint")

    with jax.sharding.use_abstract_mesh(mesh):
        assert pinned() == []
        with sharding.use_rules(preset):
            assert pinned() == want

"""Parameter creation with logical axis names, the router-bias variable type, layer stacking.

Every weight carries `logical_axes` metadata (names such as `embed`, `heads`, `expert`); the
rules in `sharding/` map those names to mesh axes. We keep the names under our own metadata key
rather than flax's `out_sharding`, which flax 0.12 shards eagerly and which requires a mesh at
construction time.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import sharding

LAYERS = "layers"


class RouterBias(nnx.Variable):
    """The auxiliary-loss-free balancing bias (HF `e_score_correction_bias`).

    Not an `nnx.Param`: the optimizer never sees it; the trainer moves it from global expert loads.
    """


def _standard_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """N(0, 1) float32 of `shape`. Traced into a program (the sharded start's jit with out_shardings,
    dsv3_jax/train/state.py) it is drawn in the parameter's own shape, so each device draws only its
    shard; a flat draw reshaped cannot be split like a parameter sharded on two dimensions. Run op
    by op (a model built eagerly) it is a flat draw reshaped, which XLA:CPU compiles faster
    (docs/benchmarks.md, Kernel choices). With the partitionable threefry (jax's default) a value
    depends on its linear index only, so both give the same numbers."""
    if isinstance(jnp.zeros(()), jax.core.Tracer):  # being staged into a program
        return jax.random.normal(key, shape, jnp.float32)
    size = int(np.prod(shape, dtype=np.int64))
    return jax.random.normal(key, (size,), jnp.float32).reshape(shape)


def normal(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], *, std: float,
           dtype) -> nnx.Param:
    if len(shape) != len(axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(axes)} differ in rank")
    value = std * _standard_normal(rngs.params(), tuple(shape))
    return nnx.Param(value.astype(dtype), logical_axes=tuple(axes))


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names of a variable (one per dimension)."""
    return tuple(variable.get_metadata()["logical_axes"])


def projections(model: nnx.Module) -> Iterator[tuple[tuple[str, ...], nnx.Module, str, int]]:
    """(path, owning module, attribute name, contracted axes) of every weight that a module of
    `model` declares in its `LORA_TARGETS` (name -> leading input axes it contracts) and holds, in
    graph order: the projections that adapters (model/lora.py) and quantization (model/quant.py)
    act on. The graph is listed first, so the caller may replace what it visits."""
    for path, node in list(nnx.iter_graph(model)):
        for name, contract in getattr(type(node), "LORA_TARGETS", {}).items():
            if isinstance(getattr(node, name, None), nnx.Variable):
                yield (*(str(p) for p in path), name), node, name, contract


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """Builds `count` independently initialised layers stacked on a leading `layers` axis."""

    # Staged into a program (the sharded start's jit), one layer at a time: the RNG's uint32
    # intermediates (~8x a leaf's shard) then exist for one layer, not for the whole stack at once.
    # Run eagerly, all layers at once (vmap). Either way layer i draws from split key i: same values.
    staged = isinstance(jnp.zeros(()), jax.core.Tracer)
    over_layers = (nnx.scan if staged else nnx.vmap)(make_layer, in_axes=(0,), out_axes=0)
    stacked = nnx.split_rngs(splits=count)(over_layers)(rngs)
    for _, node in nnx.iter_graph(stacked):
        if isinstance(node, nnx.Variable):
            node.set_metadata(logical_axes=(LAYERS,) + logical_axes(node))
    return stacked


def layer_constraint(stack: nnx.Module) -> Callable[[nnx.Module], nnx.Module]:
    """For a layer stack [L, ...] run by a scan: the function the scan body applies to its layer,
    which pins each weight to its slice of the stack's sharding under the context mesh and rules
    (`jax.set_mesh`, `sharding.use_rules`). Without the pin XLA gathers what a layer needs of the
    whole stack before the loop (every MoE layer's experts at once, and their gradients after it);
    with it, each layer's weights are gathered inside the loop, and their gradients reduced there,
    one layer at a time. The identity outside a mesh or without rules."""
    specs = stack_specs(nnx.split(stack)[1])
    if specs is None:
        return lambda layer: layer

    def constrain(layer: nnx.Module) -> nnx.Module:
        graphdef, state = nnx.split(layer)
        leaves, treedef = jax.tree.flatten(state, is_leaf=_is_variable)  # the stack's leaf order, less its L axis
        leaves = [v.replace(jax.lax.with_sharding_constraint(v[...], P(*spec[1:]))) for v, spec in zip(leaves, specs)]
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    return constrain


def stack_specs(state) -> list | None:
    """PartitionSpecs of a layer stack's weights ([L, ...], in the order of `jax.tree.leaves(state)`)
    under the context mesh and rules, or None outside a mesh or without rules."""
    mesh, rules = jax.sharding.get_abstract_mesh(), sharding.active_rules()
    if rules is None or mesh.empty or mesh.size == 1:
        return None
    return [sharding.logical_to_spec(logical_axes(v), v.shape, mesh, rules)
            for v in jax.tree.leaves(state, is_leaf=_is_variable)]


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)

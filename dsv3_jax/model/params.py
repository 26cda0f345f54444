"""Parameter creation with logical axis names, the router-bias variable type, layer stacking.

Every weight carries `logical_axes` metadata (names such as `embed`, `heads`, `expert`); the
rules in `sharding/` map those names to mesh axes. We keep the names under our own metadata key
rather than flax's `out_sharding`, which flax 0.12 shards eagerly and which requires a mesh at
construction time.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LAYERS = "layers"


class RouterBias(nnx.Variable):
    """The auxiliary-loss-free balancing bias (HF `e_score_correction_bias`).

    Not an `nnx.Param`: the optimizer never sees it; the trainer moves it from global expert loads.
    """


def _standard_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """N(0, 1) float32 of `shape`. Traced into a program (the sharded start's jit with out_shardings,
    dsv3_jax/train/state.py) it is drawn in the parameter's own shape, so each device draws only its
    shard; a flat draw reshaped cannot be split like a parameter sharded on two dimensions. Run op
    by op (a model built eagerly) it is a flat draw reshaped, which XLA:CPU compiles ~3x faster.
    With the partitionable threefry (jax's default) a value depends on its linear index only, so
    both give the same numbers."""
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


def ones(shape: Sequence[int], axes: Sequence[str | None], *, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(tuple(shape), dtype), logical_axes=tuple(axes))


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names of a variable (one per dimension)."""
    return tuple(variable.get_metadata()["logical_axes"])


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """Builds `count` independently initialised layers stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs):
        return make_layer(layer_rngs)

    stacked = make(rngs)
    for _, node in nnx.iter_graph(stacked):
        if isinstance(node, nnx.Variable):
            node.set_metadata(logical_axes=(LAYERS,) + logical_axes(node))
    return stacked


def dtype_of(name: str):
    return jnp.dtype(name)

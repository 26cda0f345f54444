"""TrainState: everything a step reads and writes, as one pytree Orbax can save and restore.

The model is split once into a static graph definition and pure dicts of arrays: `params`
(nnx.Param, seen by the optimizer) and `router_bias` (RouterBias, moved by the balancing rule).
A step merges them back into a `DeepSeekV3` inside jit, so placing these dicts with shardings is
all a mesh needs.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv3_jax.model.params import RouterBias


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 []: batches consumed (applied + skipped updates)
    params: dict  # pure dict of nnx.Param values (fp32 master weights)
    router_bias: dict  # pure dict of RouterBias values [L, E], outside the optimizer
    opt_state: optax.OptState
    rng: jax.Array  # uint32 [2]: raw PRNG key, split every step for stochastic layers
    skipped: jax.Array  # int32 []: updates skipped for a non-finite loss or gradient, in total
    consecutive_skips: jax.Array  # int32 []: ... in a row up to this step (0 after a good step)


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, Param state, RouterBias state); anything else in the model is an error."""
    graphdef, params, biases, rest = nnx.split(model, nnx.Param, RouterBias, ...)
    leftover = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(rest)[0]]
    if leftover:
        raise TypeError(f"the trainer handles nnx.Param and RouterBias variables only; the model also "
                        f"holds {leftover}")
    return graphdef, params, biases


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation, seed: int, trainable: dict | None = None
                     ) -> tuple[nnx.GraphDef, TrainState]:
    """`trainable` (`optimizer.trainable_mask`, e.g. LoRA adapters only): the parameters the
    optimizer holds state for; None: all of them."""
    from dsv3_jax.train.optimizer import select

    graphdef, params, biases = split_model(model)
    params, biases = nnx.to_pure_dict(params), nnx.to_pure_dict(biases)
    zero = jnp.zeros((), jnp.int32)
    state = TrainState(step=zero, params=params, router_bias=biases, opt_state=tx.init(select(params, trainable)),
                       rng=jax.random.key_data(jax.random.key(seed)), skipped=zero, consecutive_skips=zero)
    # Fresh buffers for every leaf (the step donates its state and XLA refuses one buffer twice),
    # committed to the device like a restored state, so both lower to the same program.
    # Leaves already spread over a mesh (parameters loaded with `load_pretrained(mesh=...)`) stay there.
    # Under tracing (eval_shape in experiments.plan) there is no placement to keep.
    def fresh(x):
        x = jnp.array(x)
        if isinstance(x, jax.core.Tracer) or len(x.sharding.device_set) > 1:
            return x
        return jax.device_put(x, jax.local_devices()[0])

    return graphdef, jax.tree.map(fresh, state)

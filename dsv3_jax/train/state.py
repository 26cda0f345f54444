"""TrainState: everything a step reads and writes, as one pytree Orbax can save and restore.

The model is split once into a static graph definition and pure dicts of arrays: `params`
(nnx.Param, seen by the optimizer) and `router_bias` (RouterBias, moved by the balancing rule).
A step merges them back into a `DeepSeekV3` inside jit, so placing these dicts with shardings is
all a mesh needs.

A run's state is built abstractly first (`abstract_train_state`: shapes only, nothing allocated),
its shardings are derived from that (dsv3_jax/train/sharded.py), and only then is it made:
`fresh_train_state` runs the whole init (model, optimizer) under `jax.jit(out_shardings=...)`, so
each device computes and holds only its own shard; `train_state_from` does the same for weights
already loaded shard by shard (`--init_from`); a resume restores into the abstract state.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv3_jax.model.params import RouterBias
from dsv3_jax.model.quant import QuantizedWeight
from dsv3_jax.train.optimizer import select


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
    """(graphdef, Param state, RouterBias state); anything else in the model is an error. A QLoRA
    base's `QuantizedWeight`s travel with the params (frozen: no optimizer mask selects them)."""
    graphdef, params, biases, rest = nnx.split(model, (nnx.Param, QuantizedWeight), RouterBias, ...)
    leftover = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(rest)[0]]
    if leftover:
        raise TypeError(f"the trainer handles nnx.Param and RouterBias variables only; the model also "
                        f"holds {leftover}")
    return graphdef, params, biases


def _state_of(params: dict, biases: dict, tx: optax.GradientTransformation, seed: int,
              trainable: dict | None = None) -> TrainState:
    """Step 0 of a run whose weights are `params` / `biases` (pure dicts). `trainable`
    (`optimizer.trainable_mask`, e.g. LoRA adapters only): the parameters the optimizer holds state
    for; None: all of them."""
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, params=params, router_bias=biases, opt_state=tx.init(select(params, trainable)),
                      rng=jax.random.key_data(jax.random.key(seed)), skipped=zero, consecutive_skips=zero)


def _pure(model: nnx.Module) -> tuple[nnx.GraphDef, dict, dict]:
    graphdef, params, biases = split_model(model)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(biases)


def abstract_train_state(model: nnx.Module, tx: optax.GradientTransformation, seed: int,
                         trainable: dict | None = None) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, TrainState of ShapeDtypeStructs) of a run's step 0 for `model`, which may be
    abstract (`nnx.eval_shape(make_model)`, whose variables keep their logical-axis metadata for the
    shardings); allocates nothing."""
    graphdef, params, biases = _pure(model)
    return graphdef, jax.eval_shape(lambda p, b: _state_of(p, b, tx, seed, trainable), params, biases)


def fresh_init(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation, seed: int,
               trainable: dict | None = None) -> Callable[[], TrainState]:
    """The function that builds a new run's step 0 (the model from `make_model`, then the optimizer
    state), to be run under `jax.jit(out_shardings=...)` or lowered (experiments.plan)."""
    def init():
        _, params, biases = _pure(make_model())
        return _state_of(params, biases, tx, seed, trainable)

    return init


def fresh_train_state(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation, seed: int,
                      shardings: TrainState, trainable: dict | None = None,
                      compiler_options: dict | None = None) -> TrainState:
    """A new run's state, initialised under jit straight into `shardings`: each device computes only
    its own shard of every parameter and moment (the RNG draws are the same as on one device).
    `compiler_options`: e.g. `host.init_compiler_options()`, for a run that compiles this once."""
    return jax.jit(fresh_init(make_model, tx, seed, trainable), out_shardings=shardings,
                   compiler_options=compiler_options)()


def train_state_from(model: nnx.Module, tx: optax.GradientTransformation, seed: int,
                     shardings: TrainState, *, donate: bool = False, trainable: dict | None = None) -> TrainState:
    """Step 0 from a model whose weights are already placed (e.g. `load_pretrained(mesh=...)`): the
    optimizer state is initialised under jit in `shardings`, every leaf a fresh buffer (the step
    donates its state). `donate`: the model's weights are consumed (their buffers reused), so the
    weights are never held twice. A weight not yet where `shardings` puts it (LoRA adapters made
    after the load) is moved there first, so a donated buffer always has its output's shape."""
    _, params, biases = _pure(model)
    if donate:
        params, biases = jax.device_put((params, biases), (shardings.params, shardings.router_bias))
    make = jax.jit(lambda p, b: _state_of(p, b, tx, seed, trainable), out_shardings=shardings,
                   donate_argnums=(0, 1) if donate else ())
    return make(params, biases)


def on_one_device(abstract: TrainState) -> TrainState:
    """Shardings of a state on this process's first device (a run without a mesh)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: device, abstract)


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation, seed: int, trainable: dict | None = None
                     ) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, step 0) of an already built model, on this process's first device (tests, benches)."""
    graphdef, abstract = abstract_train_state(model, tx, seed, trainable)
    return graphdef, train_state_from(model, tx, seed, on_one_device(abstract), trainable=trainable)

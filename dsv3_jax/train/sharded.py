"""The train state and batches placed on a mesh, and the train step jitted to keep them there.

The model side of `sharding/`: it reads each variable's `logical_axes` and asks the rules table
(`sharding.rules`) for its spec. Optimizer moments take the spec of their parameter, split over
`data` as well (ZeRO-1, as DeepSeek-V3 trains: `sharding.rules.with_axis`); step
counters, RNG and metrics are replicated; a batch [B, T + 1] is split over the `batch` rule
(data x fsdp x expert by default).

    mesh = sharding.make_mesh(sizes)
    model = nnx.eval_shape(make_model)
    graphdef, abstract = state_lib.abstract_train_state(model, tx, seed)
    shardings = train_state_shardings(model, abstract, mesh, rules)
    state = state_lib.fresh_train_state(make_model, tx, seed, shardings)  # each device: its shards
    step = make_sharded_train_step(graphdef, tx, schedule, shardings, mesh, rules, **loss_kwargs)
    state, metrics = step(state, place_batch(batch, mesh, rules))
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

import sharding
from sharding import multihost, pipeline
from dsv3_jax.model.params import logical_axes
from dsv3_jax.train import state as state_lib, step as step_lib


def variable_shardings(variables: nnx.State, mesh, rules, *, strict: bool = False) -> dict:
    """{key path tuple: (shape, NamedSharding)} for every variable of an nnx.State."""
    out = {}
    for path, var in nnx.to_flat_state(variables):
        keys = tuple(str(k) for k in path)
        shape = tuple(var.shape)
        out[keys] = (shape, sharding.named_sharding(logical_axes(var), shape, mesh, rules, strict=strict,
                                                    name="/".join(keys)))
    return out


def train_state_shardings(model: nnx.Module, state: state_lib.TrainState, mesh, rules=None) -> state_lib.TrainState:
    """A TrainState of NamedShardings (same structure as `state`) for `model`'s logical axes."""
    rules = sharding.get_rules(rules)
    _, params, biases = state_lib.split_model(model)
    flat_params = variable_shardings(params, mesh, rules)
    flat_biases = variable_shardings(biases, mesh, rules)
    rep = sharding.replicated(mesh)
    out = jax.tree.map(lambda _: rep, state)
    return out.replace(params=sharding.follow_params(state.params, flat_params, mesh),
                       router_bias=sharding.follow_params(state.router_bias, flat_biases, mesh),
                       opt_state=sharding.follow_params(state.opt_state, flat_params, mesh, zero_axis="data"))


def batch_sharding(mesh, rules=None) -> jax.sharding.NamedSharding:
    """Sharding of a [B, T + 1] batch array: rows over the `batch` rule."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.get_rules(rules)["batch"], None))


def check_batch(batch_size: int, mesh, rules=None) -> None:
    axes = sharding.get_rules(rules)["batch"]
    sharding.check_divides("data.batch_size", batch_size, mesh, (axes,) if isinstance(axes, str) else axes)


def place_batch(batch: dict, mesh, rules=None) -> dict:
    """device_put of a host batch (the global batch on one process) split over the batch axes."""
    sh = batch_sharding(mesh, rules)
    return {k: jax.device_put(np.asarray(v), sh) for k, v in batch.items()}


def make_sharded_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: Callable,
                            state_shardings: state_lib.TrainState, mesh, rules=None, **step_kwargs):
    """`make_train_step` whose outputs keep the state's shardings; inputs must already be placed.

    Runs under `jax.set_mesh(mesh)`, so with an `expert` axis the routed experts run expert-parallel
    (sharding/expert_parallel.py) and everything else is partitioned by XLA from the shardings.
    `rules` (those the state's shardings came from; default: the `default` preset, as
    `train_state_shardings`): the layer scans gather one layer's weights at a time (`sharding.use_rules`).
    """
    jit_kwargs = {"out_shardings": (state_shardings, sharding.replicated(mesh))}
    step = step_lib.make_train_step(graphdef, tx, schedule, jit_kwargs=jit_kwargs, **step_kwargs)

    def sharded_step(state, batch):
        # Traced under the mesh: the MoE layers see it and switch to all-to-all expert parallelism.
        with jax.set_mesh(mesh), sharding.use_rules(rules):
            return step(state, batch)

    def compile(state, batch) -> None:
        """Compiles the step for these arguments without running it (the call then finds it compiled)."""
        with jax.set_mesh(mesh), sharding.use_rules(rules):
            step.func.lower(state, batch, **step.keywords).compile()

    sharded_step.compile = compile
    return sharded_step


class MeshTraining(NamedTuple):
    """What the training loop needs to run on a mesh: where the state and each batch go."""

    mesh: jax.sharding.Mesh
    rules: dict
    shardings: state_lib.TrainState

    def place_batch(self, batch: dict) -> dict:
        """This process's rows (config.data.batch_size of them) -> the global batch on the mesh."""
        rows = next(iter(batch.values())).shape[0] * jax.process_count()
        return multihost.global_batch(batch, batch_sharding(self.mesh, self.rules), rows)

    def placing(self, step: Callable) -> Callable:
        """`step(state, batch)` taking this process's host batch, placed on the mesh first."""
        return lambda state, batch: step(state, self.place_batch(batch))


def check_pipeline(cfg, mesh, batch: int) -> int:
    """Microbatches of the MoE stack's pipeline schedule on `mesh` (1 without a pipeline axis), or a
    MeshError naming the config fields that do not fit."""
    if not pipeline.is_active(mesh):
        return 1
    try:
        return pipeline.check_schedule(mesh, num_layers=cfg.num_moe_layers, batch=batch,
                                       microbatches=cfg.pipeline_microbatches, repeats=cfg.pipeline_repeats)
    except ValueError as e:
        raise sharding.MeshError(f"{e} (fields: mesh.pipeline, model.pipeline_microbatches, model.pipeline_repeats, "
                                 "data.batch_size; the MoE layers are model.num_layers - model.num_dense_layers)"
                                 ) from None


def config_mesh(config) -> jax.sharding.Mesh:
    """The mesh of a training config's `mesh` section (sizes per axis, one may be -1) on all devices;
    `dcn_data` > 1 (multi-slice) lays the data axis across slices."""
    sizes = {axis: int(config.mesh[axis]) for axis in sharding.AXES if axis in config.mesh}
    slices = int(config.mesh.get("dcn_data", 1))
    return sharding.make_mesh(sizes, dcn_sizes={"data": slices} if slices > 1 else None)


def for_config(config, model: nnx.Module, state: state_lib.TrainState) -> MeshTraining | None:
    """The `mesh` section of a training config (sizes per axis, one may be -1; `rules` preset) on
    all devices; None when the mesh is a single device (the plain jit step is used then). `model`
    and `state` may be abstract (`state_lib.abstract_train_state`): only shapes and axes are read."""
    mesh = config_mesh(config)
    if mesh.size == 1:
        return None
    rules = sharding.get_rules(config.mesh.get("rules", "default"))
    cfg = model.config
    check_batch(config.data.batch_size * jax.process_count(), mesh, rules)
    sharding.check_divides("model.num_routed_experts", cfg.num_routed_experts, mesh, ("expert",))
    check_pipeline(cfg, mesh, config.data.batch_size * jax.process_count())
    return MeshTraining(mesh, rules, train_state_shardings(model, state, mesh, rules))

"""Plans a sharded run before booking the machines: per-device memory and a lowered train step.

    python -m experiments.plan --model=deepseek_v3 --devices=256 \
        --config.mesh.pipeline=1 --config.mesh.expert=64 --config.mesh.fsdp=4 --config.mesh.data=-1 \
        --config.data.batch_size=256 --config.data.seq_len=4096

Nothing is allocated: the model and train state are shapes (`nnx.eval_shape` / `jax.eval_shape`),
the mesh is a `jax.sharding.AbstractMesh` of `--devices` devices, and the train step is traced and
lowered to StableHLO for it, which checks every sharding and shape. Prints the bytes per device of
parameters, gradients, AdamW state (2 moments, in their dtype) and the activations the step holds
(`experiments/plan_memory.py`: saved tensors per layer, one layer's backward, the expert-parallel
exchange buffers, dropless the worst case of P x the device's rows, with
`model.expert_capacity_factor` cf x them; the logits of one outer microbatch; the microbatches
each pipeline schedule keeps in flight and its buffers). AdamW moments are split over `data` as
well (ZeRO-1). The
`auto` implementation choices (expert exchange, grouped matmul) are made for `--platform`, not for
this host, in the lowered program and in the count: the 671B TPU plan lowers the ragged all to
all and `ragged_dot`.

The fresh init of the train state (`dsv3_jax/train/state.py:fresh_init` under jit with the state's
shardings, as `experiments.train` runs it) is lowered too, and its outputs' bytes per device are
printed: each device initialises only its own shards.

`--check_compiled` compiles the init and the step for this host's devices instead (e.g. 8 fake CPU devices)
and prints XLA's own per-device figure beside the plan's total: `memory_analysis()` arguments +
outputs - aliased (the donated state, counted once) + temporaries.

`data.batch_size` here is the global batch (all devices).
"""

from __future__ import annotations

import functools
import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from ml_collections import config_flags

import sharding
from sharding import multihost, pipeline
from dsv3_jax import DeepSeekV3, ModelConfig, cli
from dsv3_jax.train import optimizer as optimizer_lib, sharded, state as state_lib, step as step_lib
from experiments import ledger, plan_memory
from experiments.plan_memory import LayerGroup


def define_flags(fv: flags.FlagValues) -> None:
    config_flags.DEFINE_config_file("config", "experiments/configs/tiny.py", "Training config file.", flag_values=fv)
    flags.DEFINE_integer("devices", None, "Devices of the planned mesh; default: the product of the mesh sizes (all "
                         "must be set), or this machine's device count.", flag_values=fv)
    flags.DEFINE_enum("model", "config", ["config", "deepseek_v3", "tiny"],
                      "Architecture: config.model, or a ModelConfig preset (671B / tiny).", flag_values=fv)
    flags.DEFINE_boolean("lower", True, "Trace and lower the train step (with --check_compiled: compile it).",
                         flag_values=fv)
    flags.DEFINE_enum("platform", "tpu", ["tpu", "cuda", "rocm", "cpu"], "Platform to lower for.", flag_values=fv)
    flags.DEFINE_boolean("check_compiled", False, "Compile the step on this host's devices (the mesh must use them "
                         "all) and compare memory_analysis() with the plan.", flag_values=fv)
    flags.DEFINE_boolean("ledger", False, "Print the compute ledger (experiments/ledger.py) instead of the memory "
                         "plan: FLOPs per token, step time and chip-hours.", flag_values=fv)
    flags.DEFINE_float("ledger_tokens", 14.8e12, "Token budget of the ledger (DeepSeek-V3: 14.8T).", flag_values=fv)
    flags.DEFINE_float("ledger_mfu", 0.4, "MFU (of the bf16 peak) the ledger's times assume.", flag_values=fv)
    flags.DEFINE_string("ledger_chips", "h800:2048,v5p:1024,v7x:512", "Fleets as NAME:COUNT,...", flag_values=fv)
    flags.DEFINE_float("ledger_hours", 0.0, "Reported chip-hours for the budget (DeepSeek-V3: 2.664e6 H800 hours): "
                       "prints the MFU they imply.", flag_values=fv)
    flags.DEFINE_string("ledger_hours_chip", "h800", "The chip the reported hours are on.", flag_values=fv)


GiB = 1024 ** 3


class Options(NamedTuple):
    """What to plan beyond the training config (the flags above)."""

    model: str = "config"  # "config", "deepseek_v3" or "tiny"
    devices: int | None = None  # devices of the planned mesh
    platform: str = "tpu"  # lowering platform of the abstract plan
    lower: bool = True  # trace and lower the train step
    check_compiled: bool = False  # compile on this host's devices and compare memory_analysis()
    compile_init: bool = True  # with check_compiled: compile the fresh init too

    @property
    def lowering_platform(self) -> str:
        return jax.default_backend() if self.check_compiled else self.platform


def model_config(config, opts: Options) -> ModelConfig:
    """The planned architecture; presets take the config's expert-parallel, attention and pipeline choices."""
    ep = {k: config.model[k] for k in ("expert_capacity_factor", "expert_exchange", "attention_impl", "pipeline_schedule",
                                       "pipeline_microbatches", "pipeline_repeats", "outer_microbatches")
          if k in config.model}
    if opts.model == "deepseek_v3":
        return ModelConfig.deepseek_v3().replace(remat=True, compute_dtype="bfloat16", **ep)
    if opts.model == "tiny":
        return ModelConfig.tiny(**ep)
    return ModelConfig.from_dict(config.model.to_dict())


def mesh_sizes(config) -> dict[str, int]:
    return {axis: int(config.mesh[axis]) for axis in sharding.AXES if axis in config.mesh}


def num_devices(sizes: dict[str, int], opts: Options) -> int:
    if opts.devices:
        return opts.devices
    if all(v > 0 for v in sizes.values()):
        return math.prod(sizes.values())
    return jax.device_count()


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` placed with `shardings` (the largest shard per leaf)."""
    return sum(int(np.prod(sh.shard_shape(tuple(leaf.shape)), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
               for leaf, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def abstract_train_state(cfg: ModelConfig, tx, seed: int):
    """(abstract model with metadata, graphdef, TrainState of ShapeDtypeStructs); allocates nothing."""
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(seed)))
    graphdef, state = state_lib.abstract_train_state(model, tx, seed)
    return model, graphdef, state


def plan(config, opts: Options = Options()) -> dict:
    cfg = model_config(config, opts)
    sizes = mesh_sizes(config)
    n = num_devices(sizes, opts)
    mesh = sharding.make_mesh(sizes) if opts.check_compiled else sharding.abstract_mesh(sizes, n)
    rules = sharding.get_rules(config.mesh.get("rules", "default"))
    batch, seq = config.data.batch_size, config.data.seq_len
    sharded.check_batch(batch, mesh, rules)
    sharding.check_divides("model.num_routed_experts", cfg.num_routed_experts, mesh, ("expert",))

    tx = optimizer_lib.make_optimizer(config.optimizer, config.train.steps, _decay_mask_for(cfg))
    schedule = optimizer_lib.make_schedule(config.optimizer, config.train.steps)
    model, graphdef, state = abstract_train_state(cfg, tx, config.train.seed)
    shardings = sharded.train_state_shardings(model, state, mesh, rules)

    params_b = per_device_bytes(state.params, shardings.params)
    bias_b = per_device_bytes(state.router_bias, shardings.router_bias)
    opt_b = per_device_bytes(state.opt_state, shardings.opt_state)
    total_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    layout = _activations(cfg, state, shardings, mesh, rules, batch, seq, opts)
    moment_dtypes = sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(state.opt_state)
                            if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim})
    rows = [("parameters (%s)" % jnp.dtype(cfg.param_dtype).name, params_b + bias_b),
            ("gradients", params_b), (f"AdamW moments (2 x {'/'.join(moment_dtypes)})", opt_b)]
    rows += [(f"activations: {k} (est.)", v) for k, v in layout.acts.items()]
    slot_b = _slot_copy_bytes(cfg, state, shardings, mesh, layout.stack)
    if slot_b:
        rows.append(("stage slot copy of the stack: weights + gradients", slot_b))
    total = sum(v for _, v in rows)

    _print_plan(cfg, mesh, n, config, batch, seq, layout.tokens_per_device, total_params, rows, total, layout.micro,
                layout.stack_tokens // layout.micro, layout.outer, layout.stack)
    init_compiled = report_init(cfg, tx, config.train.seed, shardings, mesh, n, opts)
    lowered_s, compiled, memory = None, None, None
    if opts.lower:
        lower = functools.partial(lower_train_step, graphdef, tx, schedule, state, shardings, mesh, rules, batch, seq,
                                  config, opts)
        lowered_s, compiled, memory = _report_lowering(lower, n, total, opts)
    return {"devices": n, "mesh": dict(mesh.shape), "total_params": total_params, "rows": dict(rows),
            "total_bytes": total, "lowered_s": lowered_s, "compiled_bytes": compiled, "compiled_memory": memory,
            "state_bytes": params_b + bias_b + opt_b, "init_compiled_bytes": init_compiled}


class _Layout(NamedTuple):
    acts: dict  # {activation kind: bytes per device}
    tokens_per_device: int
    micro: int  # pipeline microbatches
    stack_tokens: int  # tokens a stage's MoE stack sees per step
    outer: int  # microbatches of the layers outside the stack
    stack: object  # the pipeline schedule's in-flight counts, or None without pipeline


def _activations(cfg: ModelConfig, state, shardings, mesh, rules, batch: int, seq: int, opts: Options) -> _Layout:
    """The activations the step holds per device (plan_memory.py), from how the batch splits over the
    mesh, the pipeline's microbatches and schedule, and the outer layers' microbatches."""
    batch_shards = sharding.shards_of(sharded.batch_sharding(mesh, rules).spec, mesh)
    tokens_per_device = batch * seq // batch_shards
    stages, experts_axis = mesh.shape["pipeline"], mesh.shape["expert"]
    micro = sharded.check_pipeline(cfg, mesh, batch)
    stack_tokens = batch * seq // pipeline.stage_batch_shards(mesh) if stages > 1 else tokens_per_device
    outer = pipeline.outer_microbatches(batch, mesh, cfg.outer_microbatches)
    outer_tokens = tokens_per_device // outer  # the layers outside the stack work on one slice at a time
    program = plan_memory.program_for(cfg, opts.lowering_platform)
    stack = plan_memory.stack_schedule(cfg.pipeline_schedule, stages, micro, cfg.num_moe_layers,
                                       cfg.pipeline_repeats) if stages > 1 else None
    in_flight = stack_tokens if stack is None else min(stack.in_flight, micro) * (stack_tokens // micro)
    acts = plan_memory.activation_bytes(cfg, seq, [
        LayerGroup(cfg.num_dense_layers, outer_tokens, outer_tokens, False),
        LayerGroup(cfg.num_mtp_layers, outer_tokens, outer_tokens, True),
        LayerGroup(pipeline.slots_per_stage(cfg.num_moe_layers, stages, cfg.pipeline_repeats) if stack is None
                   else stack.slots, in_flight, stack_tokens // micro, True)],
        program=program, experts_axis=experts_axis, stages=stages, logit_tokens=outer_tokens, stack=stack,
        stack_tokens=stack_tokens, gathers_experts=experts_axis == 1 and _experts_split(state, shardings, mesh))
    return _Layout(acts, tokens_per_device, micro, stack_tokens, outer, stack)


def _report_lowering(lower, n: int, total: int, opts: Options):
    """Lowers the train step (`lower()`), prints what the program holds (expert exchanges, grouped
    matmuls, pipeline hand-offs) and, with --check_compiled, XLA's memory_analysis() per device beside
    the plan's total. Returns (seconds to lower, compiled bytes or None, its parts or None)."""
    t0 = time.perf_counter()
    lowered = lower()
    lowered_s = time.perf_counter() - t0
    text = lowered.as_text()
    ragged = text.count("ragged_all_to_all")
    print(f"train step traced and lowered ({opts.lowering_platform}) for the {'' if opts.check_compiled else 'abstract '}{n}-device "
          f"mesh in {lowered_s:.1f}s; expert all-to-alls in the program: {text.count('all_to_all')} "
          f"({ragged} ragged_all_to_all), grouped matmuls (ragged_dot): {text.count('ragged_dot')}, "
          f"pipeline hand-offs (collective_permute): {text.count('collective_permute')}")
    if not opts.check_compiled:
        return lowered_s, None, None
    m = lowered.compile().memory_analysis()
    memory = {k: getattr(m, f"{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
    compiled = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    # Per device: memory_analysis() of the SPMD executable. The donated state is both an
    # argument and an (aliased) output, counted once; gradients and activations are temporaries.
    print(f"compiled on this host, memory_analysis() per device: {compiled / GiB:.3f} GiB = arguments "
          f"{m.argument_size_in_bytes / GiB:.3f} + outputs {m.output_size_in_bytes / GiB:.3f} - aliased "
          f"(donated state) {m.alias_size_in_bytes / GiB:.3f} + temporaries {m.temp_size_in_bytes / GiB:.3f}; "
          f"plan total / compiled = {total / compiled:.3f}")
    return lowered_s, compiled, memory


def _slot_copy_bytes(cfg: ModelConfig, state, shardings, mesh, stack) -> int:
    """Bytes per device of the stage's own copy of its layer slots, weights and their gradients,
    where the schedule does not run the stored layout (sharding/stages.py:to_slots, dualpipev.py:
    v_layout): the uneven split (S does not divide L), circular rounds, and DualPipeV's V. Each slot
    holds one layer whole over `pipeline`, split over the stored spec's other axes only."""
    if stack is None or "moe_layers" not in state.params:
        return 0
    stages, layers = mesh.shape["pipeline"], cfg.num_moe_layers
    if cfg.pipeline_schedule in ("gpipe", "1f1b") and layers % stages == 0:
        return 0
    per_layer = 0
    for leaf, named in zip(jax.tree.leaves(state.params["moe_layers"]),
                           jax.tree.leaves(shardings.params["moe_layers"])):
        others = math.prod(mesh.shape[a] for entry in named.spec for a in ((entry,) if isinstance(entry, str)
                           else entry or ()) if a != "pipeline")
        per_layer += math.prod(leaf.shape[1:]) * jnp.dtype(leaf.dtype).itemsize // others
    held = stack.slots * (2 if cfg.pipeline_schedule == "dualpipev" else 1)  # DualPipeV: two chunks a stage
    return 2 * held * per_layer


def _experts_split(state, shardings, mesh) -> bool:
    """Whether the routed experts' weights are split over devices (then a mesh that splits tokens
    but not experts gathers them whole in each MoE layer: `expert_parallel.token_parallel`)."""
    if "moe_layers" not in state.params:
        return False
    return sharding.shards_of(shardings.params["moe_layers"]["ffn"]["w1"].spec, mesh) > 1


def _print_plan(cfg, mesh, n, config, batch, seq, tokens_per_device, total_params, rows, total, micro, live,
                outer, stack):
    stages, experts_axis = mesh.shape["pipeline"], mesh.shape["expert"]
    if stages > 1:
        per_stage = pipeline.stage_layers(cfg.num_moe_layers, stages)
        name = {"gpipe": "GPipe", "circular": "circular", "1f1b": "1F1B", "dualpipev": "DualPipeV"}[cfg.pipeline_schedule]
        print(f"pipeline: {cfg.num_moe_layers} MoE layers on {stages} stages ({per_stage.count(max(per_stage))} x "
              f"{max(per_stage)}" + (f" + {per_stage.count(min(per_stage))} x {min(per_stage)}"
                                      if min(per_stage) != max(per_stage) else "") +
              f"), {cfg.pipeline_repeats} round(s) ({name}), "
              f"{micro} microbatches, bubble (S-1)/(R*M+S-1) = "
              f"{pipeline.bubble_fraction(stages, micro, cfg.pipeline_repeats):.3f}; saved tensors of "
              f"{min(stack.in_flight, micro)} {'stash slots' if cfg.pipeline_schedule == 'dualpipev' else 'microbatches'}"
              f" x {stack.slots} layer slots in flight per stage")
    if outer > 1:
        print(f"layers outside the stack (embedding, dense, head, MTP, loss): {outer} microbatches of "
              f"{tokens_per_device // outer} tokens per device, one after another")
    if experts_axis > 1:
        cb, d = jnp.dtype(cfg.compute_dtype).itemsize, cfg.hidden_size
        dropless = plan_memory.received_rows(cfg, live, experts_axis, None)
        capped = plan_memory.received_rows(cfg, live, experts_axis, cfg.expert_capacity_factor or 1.0)
        print(f"expert parallelism: {experts_axis} devices, receive buffer per MoE layer {dropless} rows "
              f"({dropless * d * cb / GiB:.3f} GiB) dropless, {capped} rows ({capped * d * cb / GiB:.3f} GiB) with "
              f"capacity factor {cfg.expert_capacity_factor or 1.0}; planned: "
              f"{'dropless' if cfg.expert_capacity_factor is None else f'capacity factor {cfg.expert_capacity_factor}'}")
    mesh_text = ", ".join(f"{a}={s}" for a, s in mesh.shape.items())
    print(f"model: {total_params / 1e9:.2f}B parameters; mesh ({mesh_text}) = {n} devices; rules "
          f"{config.mesh.get('rules', 'default')!r}; global batch {batch} x {seq} tokens, "
          f"{tokens_per_device} tokens per device")
    print(f"{'per device':<44}{'GiB':>10}")
    for name, value in rows:
        print(f"  {name:<42}{value / GiB:>10.3f}")
    print(f"  {'total':<42}{total / GiB:>10.3f}")


def _decay_mask_for(cfg: ModelConfig):
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    _, params, _ = state_lib.split_model(model)
    return optimizer_lib.decay_mask(params)


def report_init(cfg: ModelConfig, tx, seed: int, shardings, mesh, n: int, opts: Options) -> int | None:
    """Lowers the fresh init (`state_lib.fresh_init` under jit with the state's shardings, what
    `experiments.train` runs) and prints the bytes per device of its outputs, read from the lowered
    program; with --check_compiled also compiles it and prints XLA's memory_analysis() (returned)."""
    jitted = jax.jit(state_lib.fresh_init(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(seed)), tx, seed),
                     out_shardings=shardings)
    t0 = time.perf_counter()
    if opts.check_compiled:
        with jax.set_mesh(mesh):
            lowered = jitted.trace().lower()
    else:
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = jitted.trace().lower(lowering_platforms=(opts.platform,))
    outputs = jax.tree.leaves(lowered.out_info)
    out_b = per_device_bytes(outputs, [x.sharding for x in outputs])
    print(f"train state init lowered ({opts.lowering_platform}) for the {'' if opts.check_compiled else 'abstract '}"
          f"{n}-device mesh in {time.perf_counter() - t0:.1f}s: its outputs per device {out_b / GiB:.3f} GiB "
          f"(each device initialises only its shards)")
    if not (opts.check_compiled and opts.compile_init):
        return None
    m = lowered.compile().memory_analysis()
    print(f"init compiled on this host, memory_analysis() per device: outputs {m.output_size_in_bytes / GiB:.3f} GiB "
          f"+ temporaries {m.temp_size_in_bytes / GiB:.3f} GiB")
    return m.output_size_in_bytes + m.temp_size_in_bytes


def lower_train_step(graphdef, tx, schedule, state, shardings, mesh, rules, batch: int, seq: int, config,
                     opts: Options):
    """jit(train_step).trace(...).lower() on ShapeDtypeStructs that carry the abstract shardings."""
    step = step_lib.make_train_step(graphdef, tx, schedule, mtp_weight=config.loss.mtp_weight,
                                    balance_weight=config.loss.balance_weight,
                                    bias_update_speed=config.balancing.bias_update_speed,
                                    jit_kwargs={"out_shardings": (shardings, sharding.replicated(mesh))},
                                    donate=True)  # as on TPU and GPU: the new state takes the old one's buffers
    jitted, kwargs = (step.func, step.keywords) if isinstance(step, functools.partial) else (step, {})
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    row = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=sharded.batch_sharding(mesh, rules))
    batch_sds = {"tokens": row, "segment_ids": row, "positions": row}
    if opts.check_compiled:  # a concrete mesh of this host's devices, lowered for them
        with jax.set_mesh(mesh), sharding.use_rules(rules):
            return jitted.trace(abstract, batch_sds, **kwargs).lower()
    with jax.sharding.use_abstract_mesh(mesh), sharding.use_rules(rules):
        return jitted.trace(abstract, batch_sds, **kwargs).lower(lowering_platforms=(opts.platform,))


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.log_info()
    config = args.config
    try:
        if args.ledger:
            ledger.print_ledger(model_config(config, Options(model=args.model)), config.data.seq_len,
                                tokens_per_step=config.data.batch_size * config.data.seq_len, budget=args.ledger_tokens,
                                mfu=args.ledger_mfu, fleet=ledger.parse_fleet(args.ledger_chips),
                                hours=args.ledger_hours, hours_chip=ledger.chip(args.ledger_hours_chip))
            return 0
        multihost.initialize()
        plan(config, Options(args.model, args.devices, args.platform, args.lower, args.check_compiled))
    except ValueError as e:  # MeshError, ShardingRuleError, ConfigError; the ledger's unknown chip or --ledger_chips
        return cli.fail(e)
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

"""`load_pretrained`: a thin dispatcher over the sources -> `DeepSeekV3`, each parameter built shard
by shard where it will live: an HF DeepSeek-V3 folder (bf16, fp32 or the released FP8, `load_hf`),
our Orbax checkpoint (`load_orbax`), a training run's step (`load_run`; a LoRA run with its
adapters, `load_lora_run`, whose QLoRA base is its `--init_from`: a folder above, or a PEFT
folder's base model). A PEFT folder itself is not a source here: training reads it through
`--init_from` (dsv3_jax/train/finetune.py).

The model is built abstractly (`nnx.eval_shape`, nothing allocated). Each parameter's sharding
comes from `sharding/rules.py`, the table training uses (`NamedSharding(mesh, spec)` from its
logical axes; one device without a mesh, where `offload_experts` puts the MoE layers' routed
experts in host memory instead). From an HF folder every parameter is made with
`build_array` (`jax.make_array_from_callback`, one block at a time): a block reads, from the
memory-mapped safetensors, only the rows and columns of the index a device holds (FP8
dequantised window by window), so a process reads and holds only its own devices' shards, never
a whole stacked leaf. From an Orbax item (a converted checkpoint's `params`, a run's `state`)
Orbax restores each array into its sharding (again per shard); parameters kept in FP8
(`--keep-fp8`) are dequantised shard by shard from the `fp8` item. With `weights=...` the
projections are built quantized per shard from windows of any source (`quantized`).
Every missing, extra, misshaped or wrongly typed tensor is an error naming the tensor and its file,
raised from the headers before anything is read. One exception: a run or Orbax checkpoint without
the lightning indexer (V3, V3.1) loaded with the indexer's fields as overrides (DSA's training
stages start so) gets its indexers from the model's own init (`_init_missing_indexers`).
"""
from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

import sharding
from sharding import eplb
from dsv3_jax import paths
from dsv3_jax.checkpoint import fp8, hf_names, integrity, lora_export, orbax_layout, quantized, run_folder
from dsv3_jax.checkpoint.hf_reader import HFReader, read_shard
from dsv3_jax.checkpoint.quantized import Quantization, build_array
from dsv3_jax.checkpoint.safetensors_io import CheckpointError
from dsv3_jax.config import ModelConfig
from dsv3_jax.model import DeepSeekV3, lora, moe
from dsv3_jax.model import quant as model_quant
from dsv3_jax.model.params import logical_axes


def _variables(model: nnx.Module) -> dict[tuple[str, ...], nnx.Variable]:
    return {tuple(str(p) for p in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Variable)}


def abstract_model(cfg: ModelConfig) -> tuple[DeepSeekV3, dict[tuple[str, ...], nnx.Variable]]:
    """`DeepSeekV3(cfg)` built abstractly (`nnx.eval_shape`: nothing allocated) and its variables by path."""
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    return model, _variables(model)


ROUTED_EXPERTS = ("moe_layers.ffn.w1", "moe_layers.ffn.w3", "moe_layers.ffn.w2")  # the MoE layers' routed stacks


@functools.cache
def host_sharding() -> jax.sharding.SingleDeviceSharding:
    """Where `offload_experts` builds the routed experts: host memory, as the CPU backend's device
    (every JAX install has one), whose arrays `np.asarray` views without a copy."""
    return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])


def placement_of_axes(mesh, rules, offload_experts: bool = False):
    """-> f(logical axes, shape, name) giving the sharding an array is built in: the rules table's
    `NamedSharding` on `mesh` (rules: a preset name, a {logical axis: mesh axes} dict or None for
    the default preset), or this process's first device without a mesh. `offload_experts` (no
    mesh): the routed experts of the MoE layers (float, or a QArray's q and scale) in `host_sharding`."""
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        host = host_sharding() if offload_experts else device

        def place(axes, shape, name):
            routed = name.removesuffix(".q").removesuffix(".scale") in ROUTED_EXPERTS  # float, or a QArray's parts
            return host if routed else device
        return place
    if offload_experts:
        raise ValueError("offload_experts loads onto one device and host memory: drop the mesh "
                         "(--offload_experts does not combine with --mesh)")
    table = sharding.get_rules(rules)
    return lambda axes, shape, name: sharding.named_sharding(tuple(axes), tuple(shape), mesh, table, name=name)


def load_hf(folder: str | os.PathLike, dtype, place, quantization: Quantization | None = None,
            **config_overrides) -> DeepSeekV3:
    """Builds `DeepSeekV3` from an HF folder, each parameter in `place`'s sharding (`placement_of_axes`).
    `dtype` sets the parameter dtype (default: as stored, bfloat16 for FP8 checkpoints); the compute
    dtype follows it unless overridden. `quantization`: the projections it covers are built
    quantized per shard (stored FP8 kept as it is for `fp8`)."""
    reader = HFReader(folder)
    pdtype = np.dtype(jnp.dtype(dtype)) if dtype is not None else reader.stored_dtype()
    config_overrides.setdefault("compute_dtype", pdtype.name)
    cfg = reader.config(param_dtype=pdtype.name, **config_overrides)
    infos = reader.check_all(cfg)
    model, variables = abstract_model(cfg)
    plan = quantization.plan(model) if quantization is not None else {}
    for leaf in tqdm(hf_names.leaves(cfg), desc=f"loading {os.path.basename(reader.folder)}", unit="param",
                     disable=len(reader.ckpt.names()) <= 2000):  # a bar for real checkpoints only
        keep = leaf.path in plan and quantization.fmt == "fp8" and all(
            infos[n].fp8 for _, names in hf_names.leaf_slices(leaf) for n in names)  # stored e4m3: kept as it is
        raw = reader.raw_fp8(leaf) if keep else None
        _build_leaf(leaf, variables[leaf.path], functools.partial(reader.leaf_window, leaf), raw, quantization, plan,
                    place)
    reader.compare_mtp_copies(cfg, part=(jax.process_index(), jax.process_count()))  # each process its rows
    return model


def _build_leaf(leaf: hf_names.Leaf, var, window_of, raw, quantization: Quantization | None, plan: dict,
                place) -> None:
    """Parameter `leaf` built per shard from windows of its HF-oriented tensors (`window_of(dtype)`:
    an HF folder's, or a `--keep-fp8` checkpoint's `fp8` item): quantized where `plan` covers it
    (`raw`: the stored e4m3 windows to keep as they are), else in its dtype through `read_shard`."""
    if leaf.path in plan:
        src = quantized.hf_2d(window_of(np.dtype(np.float32)))
        quantization.build(plan[leaf.path], var, leaf.path, place, src, raw)
        return
    target = np.dtype(jnp.dtype(var.dtype))
    window = window_of(target)
    var.set_value(build_array(var.shape, target, place(logical_axes(var), var.shape, ".".join(leaf.path)),
                              lambda index: read_shard(leaf, tuple(var.shape), index, window, target)))


def _stored_model(stored: ModelConfig, dtype, config_overrides: dict, place) -> tuple[DeepSeekV3, dict, set]:
    """(abstract model, its variables, the fresh indexers' paths) of a stored config with the
    caller's dtype and overrides: `dtype` sets the parameters' dtype (the compute dtype follows
    unless overridden). An indexer the stored config lacks is drawn now (`_init_missing_indexers`)."""
    if dtype is not None:
        config_overrides = {"compute_dtype": jnp.dtype(dtype).name, **config_overrides,
                            "param_dtype": jnp.dtype(dtype).name}
    model, variables = abstract_model(stored.replace(**config_overrides))
    return model, variables, _init_missing_indexers(stored, model, variables, place)


def _init_missing_indexers(stored: ModelConfig, model: DeepSeekV3, variables: dict, place) -> set:
    """The indexers' paths in `variables`, drawn by the model's init (`DeepSeekV3(cfg, Rngs(0))`
    under jit: XLA drops the rest of the init) straight into their shardings, when `model` has
    the lightning indexer and the `stored` source has none; else nothing."""
    if stored.has_indexer or not model.config.has_indexer:
        return set()
    fresh = [p for p in variables if "indexer" in p]

    def init():
        drawn = _variables(DeepSeekV3(model.config, rngs=nnx.Rngs(0)))
        return {".".join(p): drawn[p][...] for p in fresh}

    shardings = {".".join(p): place(logical_axes(variables[p]), variables[p].shape, ".".join(p)) for p in fresh}
    values = jax.jit(init, out_shardings=shardings)()
    for p in fresh:
        variables[p].set_value(values[".".join(p)])
    logging.info("lightning indexer initialised fresh: the source has none (%d parameters)", len(fresh))
    return set(fresh)


def restore_variables(item: orbax_layout.ItemReader, variables: dict, keys: dict, place, step: int | None = None,
                      manifest: dict[str, int] | None = None) -> None:
    """Orbax restore of the arrays `keys` names ({variable path: key path in `item`}), each straight
    into its sharding from `place` (`placement_of_axes`) (a process reads only its devices' shards), set into
    `variables` (the abstract model's). With `manifest`, the arrays are restored in their stored
    dtype, checked against its checksums (`integrity`) of a training `step`, then cast."""
    target = ocp.tree.from_flat_dict({key: jax.ShapeDtypeStruct(
        variables[p].shape, item.arrays[key].dtype if manifest is not None else variables[p].dtype,
        sharding=place(logical_axes(variables[p]), variables[p].shape, ".".join(p))) for p, key in keys.items()})
    integrity.quiet_abandoned_reads()
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        try:
            restored = ckptr.restore(item.dir, ocp.args.PyTreeRestore(
                target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
        except Exception as e:  # a damaged file: Orbax passes TensorStore's error on as a bare Exception
            damaged = integrity.from_read_error(step, item.dir, e)
            if damaged is None and not isinstance(e, (ValueError, KeyError, FileNotFoundError)):
                raise
            raise damaged or CheckpointError(f"{item.dir} does not hold this model's parameters ({e})") from None
    by_key = ocp.tree.to_flat_dict(restored)
    if manifest is not None:
        integrity.check(step, item.dir, manifest, {".".join(key): by_key[key] for key in keys.values()})
    for p, key in keys.items():
        variables[p].set_value(by_key[key].astype(variables[p].dtype))


def _restore_item(item: orbax_layout.ItemReader, variables: dict, keys: dict, plan: dict,
                  quantization: Quantization | None, place, step: int | None = None,
                  manifest: dict[str, int] | None = None, as_restored: bool = False) -> None:
    """The variables `keys` names ({variable path: key path in `item`}) from one Orbax item, for
    converted checkpoints and training runs alike: those `plan` covers built quantized per shard
    from windows of the stored arrays, the rest restored by Orbax (`restore_variables`). With
    `manifest` every array is checked against its checksum. `as_restored` (a run's weights): each
    window is cast to the parameter's dtype and quantized with jnp, the values `quantize_model`
    gives for the restored model (see `quantized`)."""
    restore_variables(item, variables, {p: k for p, k in keys.items() if p not in plan}, place, step, manifest)
    if manifest is not None:
        item.check(step, manifest, [".".join(keys[p]) for p in plan])
    for p, entry in plan.items():
        var, arr = variables[p], item.array(keys[p])
        dtype = var.dtype if as_restored else None
        st = model_quant.stack_dims(logical_axes(var))
        src = quantized.ours_2d(lambda index, arr=arr, dtype=dtype: np.asarray(arr[index].read().result(), dtype),
                                tuple(var.shape[st:]), entry[2])
        quantization.build(entry, var, p, place, src, xp=jnp if as_restored else np)


def load_orbax(path: str | os.PathLike, dtype, place, quantization: Quantization | None = None,
               **config_overrides) -> DeepSeekV3:
    """Restores `DeepSeekV3` from our Orbax checkpoint (see `orbax_layout`) into `place`'s shardings;
    with `quantization`, the projections it covers are built quantized per shard (the `fp8` item
    kept as it is for `fp8`)."""
    path = paths.resolve(path)  # a local folder or a URL (dsv3_jax/paths.py)
    meta = orbax_layout.read_meta(path)
    model, variables, fresh = _stored_model(ModelConfig.from_dict(meta["model"]), dtype, config_overrides, place)
    fp8_leaves = set(meta.get("fp8_leaves", []))
    stored = orbax_layout.ItemReader(path, orbax_layout.PARAMS)
    quantization, plan, int_leaves = _stored_quantization(path, meta, model, quantization)
    keys = {}
    for p, var in variables.items():
        key = ".".join(p)
        if key in fp8_leaves or key in int_leaves or p in fresh:
            continue
        if p not in stored.arrays:
            raise CheckpointError(f"parameter {key} is missing from {stored.dir} (the config in "
                                  f"{path}/config/metadata needs it)")
        shape = tuple(stored.arrays[p].shape)
        if shape != tuple(var.shape):
            raise CheckpointError(f"parameter {key} in {stored.dir} has shape {shape}, the config needs "
                                  f"{tuple(var.shape)}")
        keys[p] = p
    manifest = integrity.read_manifest(path)
    if manifest is None:
        logging.warning("%s has no checksums (converted before they were recorded): not verified", path)
    _restore_item(stored, variables, keys, {p: e for p, e in plan.items() if p in keys}, quantization, place,
                  manifest=(manifest or {}).get(orbax_layout.PARAMS))
    fp8_item = orbax_layout.ItemReader(path, orbax_layout.FP8)
    if manifest is not None:
        stored.check(None, manifest[orbax_layout.PARAMS], [".".join(p + (part,)) for p in plan
                                                           if ".".join(p) in int_leaves for part in ("q", "scale")])
        if fp8_leaves:
            fp8_item.check(None, manifest.get(orbax_layout.FP8, {}))
    for p, entry in plan.items():
        if ".".join(p) in int_leaves:  # stored quantized: each shard of q and scale read as it is
            quantization.build(entry, variables[p], p, place, stored=(stored.array(p + ("q",)),
                                                                      stored.array(p + ("scale",))))
    for leaf in hf_names.leaves(model.config):  # stored e4m3 [.., N, K]: copied for fp8, else dequantised
        if ".".join(leaf.path) in fp8_leaves:
            keep = leaf.path in plan and quantization.fmt == "fp8"
            _build_leaf(leaf, variables[leaf.path], functools.partial(_fp8_item_window, fp8_item, leaf.path),
                        _fp8_item_raw(fp8_item, leaf.path) if keep else None, quantization, plan, place)
    return model


def _stored_quantization(path: str, meta: dict, model, quantization: Quantization | None):
    """(quantization, plan, int leaves stored as q/scale) for a checkpoint that may have been written
    with `convert --quantize`: loaded in its stored format by default; another int format or group
    than the stored one is an error (the values are not there to requantize)."""
    stored = meta.get("quant")
    if stored is None:
        return quantization, (quantization.plan(model) if quantization is not None else {}), set()
    fmt, group, leaves = stored["format"], int(stored["group"]), set(stored["leaves"])
    if quantization is None:
        quantization = Quantization(fmt, "all", group)
        return quantization, {p: e for p, e in quantization.plan(model).items() if ".".join(p) in leaves}, (
            leaves if fmt != "fp8" else set())
    if fmt != "fp8" and (quantization.fmt != fmt or quantization.group != group):
        raise CheckpointError(f"{path} holds {fmt} weights (group {group}, written by convert --quantize); load it "
                              f"with weights={fmt!r}, quant_group={group} or convert the source again")
    plan = quantization.plan(model)
    plan.update({p: e for p, e in Quantization(quantization.fmt, "all", quantization.group).plan(model).items()
                 if ".".join(p) in leaves})  # every stored leaf stays quantized
    return quantization, plan, (leaves if fmt != "fp8" else set())


def _fp8_item_raw(reader: orbax_layout.ItemReader, p: tuple[str, ...]):
    """`RawFp8` windows of parameter `p` in the `fp8` item (e4m3 and scale_inv, HF orientation)."""
    arrays = {"q": reader.array(p + ("qvalue",)), "scale": reader.array(p + ("scale_inv",))}
    return lambda stack, part, rows, cols: np.asarray(arrays[part][tuple(stack) + (rows, cols)].read().result())


def _fp8_item_window(reader: orbax_layout.ItemReader, p: tuple[str, ...], target):
    """(stack, rows, cols) -> that window of parameter `p`'s HF-oriented tensor, dequantised to `target`."""
    raw, shape = _fp8_item_raw(reader, p), reader.arrays[p + ("qvalue",)].shape

    def window(stack, rows, cols):
        rows, cols = (slice(*r.indices(n)[:2]) for r, n in zip((rows, cols), shape[len(stack):]))
        return fp8.dequantize_window(functools.partial(raw, stack, "q"), functools.partial(raw, stack, "scale"),
                                     rows, cols, target)

    return window


def load_run(run: run_folder.RunStep, dtype, place, quantization: Quantization | None = None,
             **config_overrides) -> DeepSeekV3:
    """`DeepSeekV3` with a training run's step: its parameters and router biases, read from the
    step's train state (`run_folder.StateParams`) like a converted checkpoint's `params` into
    `place`'s shardings, the projections `quantization` covers built quantized per shard."""
    model, variables, fresh = _stored_model(run.model_config(), dtype, config_overrides, place)
    state = run_folder.StateParams(run)
    plan = quantization.plan(model) if quantization is not None else {}
    _restore_item(state.reader, variables, {p: state.key(p) for p in variables if p not in fresh}, plan, quantization,
                  place, run.step, integrity.read_manifest(run.step_dir), as_restored=True)
    return model


def load_lora_run(run: run_folder.RunStep, section: dict, dtype=None, *, mesh=None,
                  quantization: Quantization | None = None, offload_experts: bool = False,
                  **overrides) -> DeepSeekV3:
    """A LoRA run's model with its adapters unmerged (the model training ran): the base as
    `load_run` reads it (its routed experts in host memory with `offload_experts`), the run's
    adapters (`section`: its lora config) put on and filled from the step."""
    ckpt = run.run_dir
    if mesh is not None:
        raise CheckpointError(f"{ckpt} is a LoRA run, which loads on one device; for a mesh export it "
                              f"merged first (python -m dsv3_jax.convert --to-hf --ckpt={ckpt} --out=DIR)")
    if quantization is not None:
        raise CheckpointError(f"{ckpt} is a LoRA run; to load it with weights={quantization.fmt!r} export it merged "
                              f"first (python -m dsv3_jax.convert --to-hf --ckpt={ckpt} --out=DIR)")
    fields = {k: section[k] for k in ("rank", "alpha", "targets", "experts", "base_weights", "base_quantize")
              if k in section}
    cfg = lora.LoRAConfig(**fields)
    model = (_quantized_base(run, cfg, dtype, offload_experts, overrides) if cfg.quantized
             else load_run(run, dtype, placement_of_axes(None, None, offload_experts), **overrides))
    lora.apply(model, cfg)
    params = run_folder.StateParams(run)
    for var_path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.LoRAParam):
            var[...] = params.read(tuple(str(p) for p in var_path)).astype(var.dtype)
    return model


def _quantized_base(run, cfg, dtype, offload_experts, overrides):
    """A QLoRA run's base, quantized as the run held it: the run's --init_from loaded with its
    `base_weights` (the same quantization as the stored q and scales: deterministic)."""
    init_from = run.config().get("train", {}).get("init_from")
    if init_from and lora_export.is_peft_folder(init_from):  # started from a PEFT folder: its base
        init_from = lora_export.peft_lora_config(init_from)["base"]
    if not init_from or not os.path.exists(init_from):
        raise CheckpointError(f"{run.run_dir} is a QLoRA run (lora.base_weights={cfg.base_weights}) whose base "
                              f"--init_from={init_from!r} is no longer there; export it merged instead "
                              f"(python -m dsv3_jax.convert --to-hf --ckpt={run.run_dir} --out=DIR)")
    return load_pretrained(init_from, dtype, **cfg.load_kwargs(), offload_experts=offload_experts, **overrides)


def load_peft(folder: str, base: str | os.PathLike | None = None, dtype=None, *, mesh=None, rules=None,
              quantization: Quantization | None = None, offload_experts: bool = False,
              **config_overrides) -> DeepSeekV3:
    """A PEFT LoRA folder's model with its adapters unmerged, what `PeftModel` runs: the base model
    (`base`, else the folder's base_model_name_or_path: `lora_export.peft_base`) loaded from any
    source here (with `quantization` held quantized, a QLoRA base), then adapters put where the
    folder has them (`lora_export.peft_lora`) and read from it."""
    if mesh is not None:
        raise CheckpointError(f"{folder} is a PEFT adapter folder, which loads on one device (as a LoRA run does); "
                              "for a mesh merge it into its base first (peft's merge_and_unload, save_pretrained)")
    model = _load_source(lora_export.peft_base(folder, base), dtype, None, rules, quantization, offload_experts,
                         config_overrides)
    lora.apply(model, lora_export.peft_lora(model, folder))
    lora_export.import_peft(model, folder)
    return model


def load_pretrained(path: str | os.PathLike, dtype=None, mesh=None, *, rules=None, weights: str | None = None,
                    quantize: str | None = None, quant_group: int = 128, base: str | os.PathLike | None = None,
                    expert_placement: str | None = None, redundant_experts: int | None = None,
                    offload_experts: bool = False, **config_overrides) -> DeepSeekV3:
    """Loads a pretrained DeepSeek-V3 from our Orbax checkpoint (`python -m dsv3_jax.convert`), an
    HF folder (`config.json` + safetensors), a training run's folder (its latest step) or step folder,
    or a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) over its base model.

    dtype: parameter dtype (default: as stored; bfloat16 for FP8); the compute dtype follows it.
    mesh: build each parameter directly in `NamedSharding(mesh, spec)`, each process reading only
      its devices' shards; the spec from the parameter's logical axes through `rules`
      (sharding/rules.py: a preset name, a {logical axis: mesh axes} dict, None = "default").
    weights: None (dense, in `dtype`), "fp8", "int8" or "int4": the projections `quantize` names are
      built quantized per shard as they load (dsv3_jax/checkpoint/quantized.py) and the forward
      consumes them as they are (dsv3_jax/ops/quant.py). "fp8": e4m3 with 128x128 block scales,
      kept as stored from an FP8 HF folder or a `--keep-fp8` checkpoint (quantized so from bf16),
      run through the block-scaled matmul with 1x128 activation tiles. "int8"/"int4": weight-only,
      scales per `quant_group` rows of the contraction axis, int4 packed two per byte.
    quantize: "experts" (the routed experts; int8/int4's default) or "all" (every projection the
      released checkpoint stores in FP8; fp8's default).
    base: with a PEFT folder, its base model (any of the other sources), as
      `PeftModel.from_pretrained(base, folder)` takes it; default: the folder's
      base_model_name_or_path, as `AutoPeftModelForCausalLM` reads it (a local folder: nothing is
      downloaded). The adapters stay unmerged, on the base quantized as `weights` says.
    expert_placement, redundant_experts: an EPLB placement file (`python -m experiments.eplb`) and/or
      a count of redundant experts (alone: placed for a uniform load); the routed experts are laid
      out as its physical experts (dsv3_jax/model/moe.py:place_experts, sharding/eplb.py).
    offload_experts: build the MoE layers' routed experts in host memory (`host_sharding`, no mesh),
      never on the accelerator, for `inference.expert_cache.ExpertOffload` (which the model then
      needs to run: it keeps a cache of them per layer on the device).
    config_overrides: ModelConfig fields to change (e.g. `moe_impl`, `num_mtp_layers=0`).
    """
    placed = expert_placement is not None or redundant_experts is not None
    if offload_experts and placed:
        raise ValueError("offload_experts does not combine with an expert placement: drop expert_placement and "
                         "redundant_experts")
    path = os.fspath(path)
    quantization = Quantization(weights, quantize, quant_group) if weights is not None else None
    if quantization is None and quantize is not None:
        raise ValueError(f"quantize={quantize!r} needs weights='fp8', 'int8' or 'int4'")
    if lora_export.is_peft_folder(path):
        model = load_peft(path, base, dtype, mesh=mesh, rules=rules, quantization=quantization,
                          offload_experts=offload_experts, **config_overrides)
    elif base is not None:
        raise ValueError(f"base={os.fspath(base)!r} is the base model of a PEFT adapter folder; {path} is none "
                         "(it has no adapter_config.json)")
    else:
        model = _load_source(path, dtype, mesh, rules, quantization, offload_experts, config_overrides)
    if placed:
        cfg = model.config
        devices = 1 if mesh is None else mesh.shape.get("expert", 1)
        moe.place_experts(model.moe_layers.ffn, eplb.placement_for(
            expert_placement, redundant_experts, num_layers=cfg.num_moe_layers, num_experts=cfg.num_routed_experts,
            num_groups=cfg.num_expert_groups, num_devices=devices))
    return model


def _load_source(path: str, dtype, mesh, rules, quantization: Quantization | None, offload_experts: bool,
                 config_overrides: dict):
    """The model of a run, an Orbax checkpoint or an HF folder (`load_pretrained`'s dispatch)."""
    if (run := run_folder.find(path)) is not None:  # a training run's folder or one of its steps
        if (section := run.config().get("lora")) is not None:  # a LoRA run: its base with its adapters
            return load_lora_run(run, section, dtype, mesh=mesh, quantization=quantization,
                                 offload_experts=offload_experts, **config_overrides)
        loader, source = load_run, run
    elif orbax_layout.is_orbax_checkpoint(path):
        loader, source = load_orbax, path
    elif os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        loader, source = load_hf, path
    else:
        raise CheckpointError(f"{path} is not a checkpoint: expected an Orbax checkpoint written by "
                              "`python -m dsv3_jax.convert` (config/metadata, params/) or an HF folder with "
                              "config.json and model.safetensors or model.safetensors.index.json, a training run's "
                              "folder (model_config.json, checkpoints/<step>) or a PEFT folder (adapter_config.json)")
    return loader(source, dtype, placement_of_axes(mesh, rules, offload_experts), quantization, **config_overrides)

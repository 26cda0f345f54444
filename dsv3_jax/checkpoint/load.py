"""`load_pretrained`: our Orbax checkpoint or an HF DeepSeek-V3 folder (bf16, fp32 or the released
FP8) -> `DeepSeekV3`.

The model is built abstractly (`nnx.eval_shape`, nothing allocated). From an Orbax checkpoint
(`python -m dsv3_jax.convert`) Orbax restores every parameter directly into its target sharding
(with a mesh: `NamedSharding`s from the logical axis rules, no host copy of the model). Parameters
kept in FP8 (`--keep-fp8`) are dequantised on the host one slice at a time, as for HF folders.
From an HF folder each parameter is filled from memory-mapped safetensors one leaf at a time.
Every missing, extra, misshaped or wrongly typed tensor is an error naming the tensor and its file.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dsv3_jax.checkpoint import fp8, hf_names, orbax_layout, run_folder
from dsv3_jax.checkpoint.hf_to_orbax import leaf_slices, slice_to_ours
from dsv3_jax.checkpoint.shardings import Rules, sharding_for
from dsv3_jax.checkpoint.safetensors_io import CheckpointError, HFCheckpoint
from dsv3_jax.config import ModelConfig
from dsv3_jax.model import DeepSeekV3

FP8_BLOCK = fp8.BLOCK
dequantize_fp8 = fp8.dequantize
_FLOATS = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


class _Reader:
    """Reads HF tensors by name with shape and dtype checks and FP8 dequantisation."""

    def __init__(self, ckpt: HFCheckpoint, dtype: np.dtype):
        self.ckpt, self.dtype, self.used = ckpt, dtype, set()

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        arr = self.ckpt.get(name)
        self.used.add(name)
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name} in {self.ckpt.where(name)} has shape {tuple(arr.shape)}, "
                                  f"the config needs {tuple(shape)}")
        if arr.dtype == _FP8:
            scale_name = name.replace(".weight", ".weight_scale_inv")
            if scale_name not in self.ckpt:
                raise CheckpointError(f"FP8 tensor {name} in {self.ckpt.where(name)} has no {scale_name}")
            scale = self.ckpt.get(scale_name)
            self.used.add(scale_name)
            blocks = tuple(-(-n // FP8_BLOCK) for n in shape)
            if tuple(scale.shape) != blocks:
                raise CheckpointError(f"tensor {scale_name} in {self.ckpt.where(scale_name)} has shape "
                                      f"{tuple(scale.shape)}, expected {blocks} for {name} {tuple(shape)}")
            return dequantize_fp8(arr, scale).astype(self.dtype)
        if arr.dtype not in _FLOATS:
            raise CheckpointError(f"tensor {name} in {self.ckpt.where(name)} has dtype {arr.dtype}; "
                                  "expected a float type (float32, bfloat16, float16 or float8_e4m3fn)")
        return arr.astype(self.dtype)


def _stored_dtype(ckpt: HFCheckpoint) -> np.dtype:
    dtype = ckpt.get("model.embed_tokens.weight").dtype if "model.embed_tokens.weight" in ckpt else None
    if dtype is None or dtype == _FP8:
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _variables(model: nnx.Module) -> dict[tuple[str, ...], nnx.Variable]:
    return {tuple(str(p) for p in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Variable)}


def _placement(mesh, rules):
    """-> f(path, variable) giving the sharding a parameter is restored into."""
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return lambda path, var: device
    from dsv3_jax.model.params import logical_axes

    return lambda path, var: sharding_for(path, logical_axes(var), tuple(var.shape), mesh, rules)


def load_hf(folder: str | os.PathLike, dtype=None, *, mesh=None, rules: Rules | None = None,
            progress: bool | None = None, **config_overrides) -> DeepSeekV3:
    """Builds `DeepSeekV3` from an HF folder. `dtype` sets the parameter dtype (default: as stored,
    bfloat16 for FP8 checkpoints); the compute dtype follows it unless overridden."""
    folder = os.fspath(folder)
    ckpt = HFCheckpoint(folder)
    pdtype = np.dtype(jnp.dtype(dtype)) if dtype is not None else _stored_dtype(ckpt)
    cfg = ModelConfig.from_hf_config(folder)
    if cfg.num_mtp_layers and not _has_mtp(ckpt, cfg) and "num_mtp_layers" not in config_overrides:
        # transformers drops layer `num_hidden_layers` on load, so its re-saves carry no MTP weights.
        logging.warning("%s: config.json has %d MTP layer(s) but no MTP tensors; loading without MTP",
                        folder, cfg.num_mtp_layers)
        config_overrides["num_mtp_layers"] = 0
    config_overrides.setdefault("compute_dtype", pdtype.name)
    cfg = cfg.replace(param_dtype=pdtype.name, **config_overrides)
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    variables = _variables(model)
    place = _placement(mesh, rules)
    reader = _Reader(ckpt, pdtype)
    table = hf_names.leaves(cfg)
    show = progress if progress is not None else len(ckpt.names()) > 2000
    for leaf in tqdm(table, desc=f"loading {os.path.basename(folder)}", unit="param", disable=not show):
        var = variables[leaf.path]
        target = np.dtype(jnp.dtype(var.dtype))
        value = np.empty(var.shape, target)
        slices = leaf.hf_layers if leaf.hf_layers is not None else (None,)
        for i, layer in enumerate(slices):
            names = leaf.hf(layer)
            xs = [reader.read(n, s) for n, s in zip(names, leaf.hf_shapes())]
            part = leaf.to_ours(xs).astype(target)
            if leaf.hf_layers is None:
                value = part
            else:
                value[i] = part
        var.set_value(jax.device_put(value, place(leaf.path, var)))
    _check_shared_copies(reader, cfg)
    extra = sorted(set(ckpt.names()) - reader.used)
    if extra:
        shown = ", ".join(f"{n} ({ckpt.where(n)})" for n in extra[:5])
        raise CheckpointError(f"{len(extra)} unexpected tensor(s) in {folder} that the config "
                              f"does not use: {shown}{' ...' if len(extra) > 5 else ''}")
    return model


def _has_mtp(ckpt: HFCheckpoint, cfg: ModelConfig) -> bool:
    prefix = f"model.layers.{cfg.num_layers}."
    return any(name.startswith(prefix) for name in ckpt.names())


def _check_shared_copies(reader: _Reader, cfg: ModelConfig) -> None:
    """MTP layers store the embedding and head again; they must equal the main ones."""
    for copy, main in hf_names.mtp_shared_copies(cfg):
        if copy not in reader.ckpt:
            continue
        a = reader.read(copy, reader.ckpt.shape(main))
        b = reader.read(main, reader.ckpt.shape(main))
        if not np.array_equal(a, b):
            logging.warning("%s differs from %s; the MTP module uses the main model's copy", copy, main)


def load_orbax(path: str | os.PathLike, dtype=None, *, mesh=None, rules: Rules | None = None,
               **config_overrides) -> DeepSeekV3:
    """Restores `DeepSeekV3` from our Orbax checkpoint (see `orbax_layout`)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    meta = orbax_layout.read_meta(path)
    cfg = ModelConfig.from_dict(meta["model"])
    pdtype = np.dtype(jnp.dtype(dtype if dtype is not None else cfg.param_dtype))
    if dtype is not None:
        config_overrides.setdefault("compute_dtype", pdtype.name)
    cfg = cfg.replace(param_dtype=pdtype.name, **config_overrides)
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    variables = _variables(model)
    place = _placement(mesh, rules)
    fp8_leaves = set(meta.get("fp8_leaves", []))
    params_dir = os.path.join(path, orbax_layout.PARAMS)
    stored = orbax_layout.ItemReader(path, orbax_layout.PARAMS)
    stored_keys = orbax_layout.item_keys(path, orbax_layout.PARAMS)
    target: dict = {}
    for p, var in variables.items():
        key = ".".join(p)
        if key in fp8_leaves:
            continue
        if p not in stored_keys:
            raise CheckpointError(f"parameter {key} is missing from {params_dir} (the config in "
                                  f"{path}/config/metadata needs it)")
        shape = tuple(stored.array(p).shape)
        if shape != tuple(var.shape):
            raise CheckpointError(f"parameter {key} in {params_dir} has shape {shape}, the config needs "
                                  f"{tuple(var.shape)}")
        node = target
        for k in p[:-1]:
            node = node.setdefault(k, {})
        node[p[-1]] = jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=place(p, var))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        restored = ckptr.restore(params_dir, ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    for keypath, value in jax.tree_util.tree_flatten_with_path(restored)[0]:
        variables[tuple(k.key for k in keypath)].set_value(value)
    if fp8_leaves:
        _restore_fp8(path, cfg, variables, fp8_leaves, place)
    return model


def _restore_fp8(path: str, cfg: ModelConfig, variables, fp8_leaves: set[str], place) -> None:
    """Dequantises the `fp8` item one slice at a time into each parameter's dtype and layout."""
    reader = orbax_layout.ItemReader(path, orbax_layout.FP8)
    for leaf in hf_names.leaves(cfg):
        if ".".join(leaf.path) not in fp8_leaves:
            continue
        var = variables[leaf.path]
        target = np.dtype(jnp.dtype(var.dtype))
        value = np.empty(var.shape, target)
        for index, _ in leaf_slices(leaf):
            q = reader.read(leaf.path + ("qvalue",), index)
            s = reader.read(leaf.path + ("scale_inv",), index)
            part = slice_to_ours(leaf, index, [fp8.dequantize(q, s).astype(target)])
            if index:
                value[index] = part
            else:
                value = part
        var.set_value(jax.device_put(value, place(leaf.path, var)))


def load_pretrained(path: str | os.PathLike, dtype=None, mesh=None, *, rules: Rules | None = None,
                    **config_overrides) -> DeepSeekV3:
    """Loads a pretrained DeepSeek-V3 from our Orbax checkpoint (`python -m dsv3_jax.convert`), an
    HF folder (`config.json` + safetensors), or a training run's folder (its latest step) or step folder.

    dtype: parameter dtype (default: as stored; bfloat16 for FP8); the compute dtype follows it.
    mesh: restore each parameter directly into `NamedSharding(mesh, spec)`, the spec from its
      logical axes through `rules` (a {logical axis: mesh axis} dict, default
      `shardings.DEFAULT_RULES`, or a callable (path, logical axes, shape) -> PartitionSpec).
    config_overrides: ModelConfig fields to change (e.g. `moe_impl`, `num_mtp_layers=0`).
    """
    path = os.fspath(path)
    if (run := run_folder.find(path)) is not None:  # a training run's folder or one of its steps
        return run_folder.load_run(run, dtype, mesh=mesh, rules=rules, **config_overrides)
    if orbax_layout.is_orbax_checkpoint(path):
        return load_orbax(path, dtype, mesh=mesh, rules=rules, **config_overrides)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        return load_hf(path, dtype, mesh=mesh, rules=rules, **config_overrides)
    raise CheckpointError(f"{path} is not a checkpoint: expected an Orbax checkpoint written by "
                          "`python -m dsv3_jax.convert` (config/metadata, params/) or an HF folder with "
                          "config.json and model.safetensors or model.safetensors.index.json, or a training run's "
                          "folder (model_config.json, checkpoints/<step>)")

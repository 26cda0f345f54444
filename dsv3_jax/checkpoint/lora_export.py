"""A LoRA run's weights out of its training folder: merged into the base (an HF folder like any
run's), or the adapters alone as a PEFT LoRA folder for transformers' DeepseekV3.

The run's config.json holds its `lora` section (rank, alpha); its step's train state holds each
adapter beside its weight (`params/<path>_lora/a` [*batch, *in, r], `.../b` [*batch, r, *out]).
Both exports read one [layer] slice at a time, like the base export.

PEFT layout (peft.LoraModel, one nn.Linear [out, in] per HF module): `lora_A.weight` [r, in],
`lora_B.weight` [out, r], update (lora_alpha / r) B A, keys
`base_model.model.<module>.lora_A.weight`. Our a and b flatten their in/out axes in the order the
HF weight does (the converter's reshape), so lora_A = a^T and lora_B = b^T after flattening.
PEFT folders carry the MLA adapters (target_modules) and the dense and shared-expert MLP adapters
(target_parameters: `peft_config` says why); routed-expert and MTP adapters export merged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from dsv3_jax import paths
from dsv3_jax.checkpoint import hf_names
from dsv3_jax.checkpoint.run_folder import StateParams
from dsv3_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from dsv3_jax.model import DeepSeekV3, lora
from dsv3_jax.model import quant as model_quant
from dsv3_jax.model.lora import low_rank_delta
from dsv3_jax.model.params import projections
from dsv3_jax.ops import quant

ADAPTER = "_lora"
ADAPTER_FILE = "adapter_model.safetensors"


def _adapter_path(path: tuple[str, ...]) -> tuple[str, ...]:
    return (*path[:-1], path[-1] + ADAPTER)


class MergedParams:
    """A run step's parameters with every adapter folded in: read(path, index) = W + s A B at that
    slice (the reader of `orbax_to_hf.write_hf`). `quantized` (a QLoRA run): weight path -> the
    abstract `QArray` its stored q and scale make; those slices are dequantized to fp32 first."""

    def __init__(self, params, keys: set[tuple[str, ...]], scale: float, quantized: dict | None = None):
        self.params, self.keys, self.scale, self.quantized = params, keys, scale, quantized or {}

    def _weight(self, path, index) -> np.ndarray:
        layout = self.quantized.get(path)
        if layout is None:
            return self.params.read(path, index)
        q, s = (jnp.asarray(self.params.read((*path, part), index)) for part in ("q", "scale"))
        return np.asarray(quant.dequantize(dataclasses.replace(layout, q=q, scale=s), jnp.float32))

    def read(self, path: tuple[str, ...], index=()) -> np.ndarray:
        w = self._weight(path, index)
        ad = _adapter_path(path)
        if ("params", *ad, "a") not in self.keys:
            return w
        a, b = self.params.read((*ad, "a"), index), self.params.read((*ad, "b"), index)
        batch = a.ndim + b.ndim - 2 - w.ndim
        return (w.astype(np.float32) + low_rank_delta(a, b, batch, self.scale)).astype(w.dtype)


def merged_params(run, params):
    """`params` (a `run_folder.StateParams`) merged with the run's adapters; as is without LoRA."""
    section = run.config().get("lora")
    if section is None:
        return params
    return MergedParams(params, params.keys, section["alpha"] / section["rank"], quantized_layout(run, section))


def quantized_layout(run, section: dict) -> dict:
    """A QLoRA run's quantized weights: path -> abstract `QArray` (format, group, shapes), from the
    model quantized as the run held it, built abstractly (nothing allocated). Empty otherwise."""
    fmt = section.get("base_weights", "none")
    if fmt == "none":
        return {}
    which = section.get("base_quantize", "all")
    abstract = nnx.eval_shape(lambda: model_quant.quantize_model(DeepSeekV3(run.model_config(), rngs=nnx.Rngs(0)),
                                                                 fmt, which))
    return {path: getattr(node, name)[...] for path, node, name, _ in model_quant.targets(abstract, which)}


def peft_tensors(cfg, params, keys) -> dict[str, np.ndarray]:
    """PEFT state dict of every adapter of the run; an error for adapters PEFT cannot express."""
    out = {}
    for leaf in hf_names.leaves(cfg):
        if ("params", *_adapter_path(leaf.path), "a") not in keys:
            continue
        if hf_names.stacked_dims(leaf) == 2 or leaf.path[0] == "mtp":
            raise CheckpointError(
                f"the adapter on {'/'.join(leaf.path)} has no PEFT module in transformers' DeepseekV3 "
                "(routed experts and MTP layers): export the merged model instead (without --adapter_only)")
        ad = _adapter_path(leaf.path)
        for index, names in hf_names.leaf_slices(leaf):
            a, b = params.read((*ad, "a"), index), params.read((*ad, "b"), index)
            module = "base_model.model." + names[0].removesuffix(".weight")
            r = a.shape[-1]
            out[f"{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
            out[f"{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
    return out


def _is_mlp(module: str) -> bool:
    return module.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")


def peft_config(section: dict, modules: list[str], base: str | None) -> dict:
    """adapter_config.json. MLA modules: `target_modules`, the exact HF modules as a regex (PEFT
    full-matches a string). Dense and shared-expert MLPs: `target_parameters`, their exact weights
    (`model.layers.0.mlp.gate_proj.weight`): PEFT on transformers 5 rewrites every `target_modules`
    name ending in gate_proj/up_proj/down_proj to DeepseekV3's fused routed experts
    (peft/utils/transformers_weight_conversion.py, `_convert_peft_config_moe`), while
    `target_parameters` pass through it and put a `ParamWrapper` (W + s B A) on exactly those
    weights, under the same state-dict keys. A ParamWrapper refuses lora_dropout != 0, so a folder
    with MLP adapters records lora_dropout 0 (dropout is training-only: the adapters' values and the
    inference are the same)."""
    attn, mlp = [m for m in modules if not _is_mlp(m)], [m for m in modules if _is_mlp(m)]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": section["rank"], "lora_alpha": section["alpha"],
            "lora_dropout": 0.0 if mlp else section.get("dropout", 0.0), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base, "target_modules": "|".join(re.escape(m) for m in attn) or None,
            "target_parameters": [f"{m}.weight" for m in mlp] or None, "modules_to_save": None}


def export_adapter(run, out: str, *, overwrite: bool = False, base: str | None = None) -> dict:
    """PEFT folder `out` (adapter_config.json, adapter_model.safetensors) with the run's adapters."""
    section = run.config().get("lora")
    if section is None:
        raise CheckpointError(f"{run.run_dir} is not a LoRA run (its config.json has no lora section)")
    if os.path.exists(out) and not overwrite:
        raise CheckpointError(f"{out} already exists; remove it or pass --overwrite")
    params = StateParams(run)
    params.check()
    tensors = peft_tensors(run.model_config(), params, params.keys)
    modules = sorted({_module(k) for k in tensors})
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, ADAPTER_FILE), metadata={"format": "pt"})
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(peft_config(section, modules, base), f, indent=2)
    return {"out": out, "tensors": len(tensors), "modules": len(modules), "step": run.step}


def is_peft_folder(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), "adapter_config.json"))


# adapter_config.json fields with the value plain LoRA has (absent or empty counts as plain)
_PLAIN = (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none"),
          ("lora_bias", False), ("rank_pattern", None), ("alpha_pattern", None), ("modules_to_save", None),
          ("layer_replication", None))


def peft_lora_config(folder) -> dict:
    """rank, alpha and the base model of a PEFT LoRA folder; an error for what we cannot load."""
    with open(os.path.join(folder, "adapter_config.json")) as f:
        meta = json.load(f)
    if meta.get("peft_type") != "LORA":
        raise CheckpointError(f"{folder}/adapter_config.json: peft_type {meta.get('peft_type')!r} is not LORA")
    for field, plain in _PLAIN:
        if (meta.get(field) or plain) != plain:
            raise CheckpointError(f"{folder}/adapter_config.json: {field}={meta[field]!r} is not supported "
                                  f"(plain LoRA only: {field}={plain!r})")
    try:
        return {"rank": int(meta["r"]), "alpha": float(meta["lora_alpha"]), "base": meta.get("base_model_name_or_path")}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{folder}/adapter_config.json needs a number for r and lora_alpha ({e!r})") from None


def peft_base(folder, base=None) -> str:
    """The base model of a PEFT folder: `base` when given (as `PeftModel.from_pretrained(base, folder)`
    takes it), else the folder's base_model_name_or_path (as `AutoPeftModelForCausalLM` reads it),
    which must be a local folder or a URL: nothing is downloaded from a hub."""
    base = os.fspath(base) if base is not None else peft_lora_config(folder)["base"]
    if not base or not (paths.is_url(base) or os.path.exists(base)):
        raise CheckpointError(f"{folder}/adapter_config.json names the base model {base!r}, which is no local folder: "
                              "pass base= (its HF folder, our checkpoint or a training run)")
    return base


def _module(key: str) -> str:
    """The HF module of an adapter tensor: base_model.model.<module>.lora_A.weight -> <module>."""
    return key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]


def peft_lora(model, folder) -> lora.LoRAConfig:
    """The `LoRAConfig` that puts adapters on `model` where a PEFT folder has them: its rank and
    alpha, and as targets our paths of the HF modules its adapter_model.safetensors holds (so PEFT's
    target_modules, target_parameters and layers_to_transform come as the file resolved them)."""
    meta = peft_lora_config(folder)
    adaptable = {"/".join(path) for path, *_ in projections(model)}
    ours = {names[0].removesuffix(".weight"): leaf for leaf in hf_names.leaves(model.config)
            if "/".join(leaf.path) in adaptable for _, names in hf_names.leaf_slices(leaf)}  # experts: one each
    leaves = {}
    for module in sorted({_module(k) for k in SafetensorsFile(os.path.join(folder, ADAPTER_FILE)).keys()}):
        if module not in ours:
            raise CheckpointError(f"{folder}/{ADAPTER_FILE} has an adapter on {module}, which is not a projection "
                                  "of this model that LoRA adapts (attention and MLP projections)")
        leaves[ours[module].path] = ours[module]
    routed = sorted(path[-1] for path, leaf in leaves.items() if hf_names.stacked_dims(leaf) == 2)
    if routed and routed != ["w1", "w2", "w3"]:  # the grouped expert matmul takes the three adapters together
        raise CheckpointError(f"{folder}/{ADAPTER_FILE} adapts the routed experts' {routed} only; routed experts "
                              "load with adapters on all of gate_proj (w1), up_proj (w3) and down_proj (w2)")
    return lora.LoRAConfig(rank=meta["rank"], alpha=meta["alpha"],
                           targets="|".join(re.escape("/".join(p)) for p in sorted(leaves)),
                           experts=any(hf_names.stacked_dims(leaf) == 2 for leaf in leaves.values()))


def import_peft(model, folder) -> list[str]:
    """Fills the adapters of `model` (put on by `lora.apply` with the folder's rank and alpha) from a
    PEFT folder, one HF module at a time. A slice the folder has no module for (a layer PEFT's
    layers_to_transform left out) keeps its fresh adapter, whose zero B adds nothing; an adapter none
    of whose modules is in the file, and a module of the file without an adapter, are errors.
    Returns the modules read."""
    nodes = {tuple(str(p) for p in path): node for path, node in nnx.iter_graph(model)}
    f = SafetensorsFile(os.path.join(folder, ADAPTER_FILE))
    keys, used = set(f.keys()), []
    for leaf in hf_names.leaves(model.config):
        owner = nodes.get(leaf.path[:-1])
        ad = None if owner is None else lora.adapter(owner, leaf.path[-1])
        if ad is None:
            continue
        slices = [(index, "base_model.model." + names[0].removesuffix(".weight"))
                  for index, names in hf_names.leaf_slices(leaf)]
        found = [(index, module) for index, module in slices if f"{module}.lora_A.weight" in keys]
        if not found:
            raise CheckpointError(f"{folder}: no {slices[0][1]}.lora_A.weight (nor of another layer) for the "
                                  f"adapter on {'/'.join(leaf.path)}; check lora.targets against the folder's modules")
        a, b = np.array(ad.a[...]), np.array(ad.b[...])
        for index, module in found:
            a[index] = f.read(f"{module}.lora_A.weight").T.reshape(a[index].shape)
            b[index] = f.read(f"{module}.lora_B.weight").T.reshape(b[index].shape)
            used.append(module)
        ad.a[...], ad.b[...] = a, b
    extra = {k.rsplit(".lora_", 1)[0] for k in keys} - set(used)
    if extra:
        raise CheckpointError(f"{folder} has adapters for modules the model's LoRA targets leave out: "
                              f"{sorted(extra)[:4]}; widen lora.targets")
    return used

"""`load_pretrained`: an HF DeepSeek-V3 folder (bf16, fp32 or the released FP8) -> `DeepSeekV3`.

The model is built abstractly (`nnx.eval_shape`, nothing allocated), then each parameter is filled
from memory-mapped safetensors one leaf at a time, so peak host memory is one parameter plus the
model itself. Every missing, extra, misshaped or wrongly typed tensor is an error naming the
tensor and its file.
"""

from __future__ import annotations

import logging
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dsv3_jax.checkpoint import hf_names
from dsv3_jax.checkpoint.safetensors_io import CheckpointError, HFCheckpoint
from dsv3_jax.config import ModelConfig
from dsv3_jax.model import DeepSeekV3

FP8_BLOCK = 128
_FLOATS = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def dequantize_fp8(q: np.ndarray, scale_inv: np.ndarray, *, block: int = FP8_BLOCK) -> np.ndarray:
    """fp32(q) * s[i // 128, j // 128] (partial edge blocks allowed), in float32."""
    rows, cols = q.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block, axis=0), block, axis=1)[:rows, :cols]
    return q.astype(np.float32) * s


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


def load_hf(folder: str | os.PathLike, dtype=None, *, progress: bool | None = None,
            **config_overrides) -> DeepSeekV3:
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
        var.set_value(jnp.asarray(value))
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


def load_pretrained(path: str | os.PathLike, dtype=None, **config_overrides) -> DeepSeekV3:
    """Loads a pretrained DeepSeek-V3 from an HF folder (`config.json` + safetensors)."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        return load_hf(path, dtype, **config_overrides)
    raise CheckpointError(f"{path} is not a checkpoint: expected an HF folder with config.json and "
                          "model.safetensors or model.safetensors.index.json")

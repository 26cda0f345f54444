"""Our Orbax checkpoint -> an HF DeepSeek-V3 folder (shards, index, config.json), streamed.

Tensors come out under the hub's names (per-expert `mlp.experts.J.*`, MTP as layer
`num_hidden_layers + k` with its `embed_tokens` / `shared_head.head` copies when the source had
them), each read from the Orbax arrays one [layer] or [layer, expert] slice at a time.

dtype: per parameter, the dtype the HF source had (recorded at conversion; so bf16 and fp32 round
trips are bit-exact) unless `dtype` is given. `fp8=True` writes the quantisable projections as
e4m3 + `weight_scale_inv`: the stored bytes and scales where the checkpoint kept them
(`--keep-fp8`), otherwise block-quantised here (`fp8.quantize`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from dsv3_jax.checkpoint import fp8, hf_names, hf_tokenizer, lora_export, orbax_layout, run_folder
from dsv3_jax.checkpoint.hf_names import leaf_slices, slice_to_hf
from dsv3_jax.checkpoint.hf_reader import scale_name
from dsv3_jax.checkpoint.hf_to_orbax import begin_output, commit
from dsv3_jax.checkpoint.safetensors_io import CheckpointError, ShardWriter
from dsv3_jax.config import ModelConfig
from dsv3_jax.data.tokenizer import BUNDLED_PATH

DEFAULT_SHARD_BYTES = 5 * 10**9


@dataclasses.dataclass
class _Tensor:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]


def _layer_of(name: str) -> int:
    """For ordering: the HF layer of tensor `name`; -1 before the layers, 10**9 after."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1))
    return -1 if name.startswith("model.embed_tokens") else 10**9


class _Source:
    """Reads HF-oriented slices from the checkpoint: from `params`, or dequantised / raw from `fp8`.
    `params` is anything with `read(path, index)` (a slice of one parameter), e.g. an
    `orbax_layout.ItemReader`; a training run's state is read through `run_folder`'s adapter."""

    def __init__(self, params, fp8_reader: orbax_layout.ItemReader | None, meta: dict):
        self.params = params
        self.fp8 = fp8_reader
        self.fp8_leaves = set(meta.get("fp8_leaves", []))
        self.pow2 = meta["model"].get("scale_fmt") == "ue8m0"  # V3.1: power-of-two (UE8M0) block scales
        self._last: tuple = (None, None)

    def raw_fp8(self, leaf: hf_names.Leaf, index) -> tuple[np.ndarray, np.ndarray]:
        return (self.fp8.read(leaf.path + ("qvalue",), index), self.fp8.read(leaf.path + ("scale_inv",), index))

    def fp8_pair(self, leaf: hf_names.Leaf, index) -> tuple[np.ndarray, np.ndarray]:
        """(e4m3, scale_inv) of the slice's HF tensor: as kept (`--keep-fp8`) or block-quantised
        here; the last one is cached since its scale is written right after."""
        key = (leaf.path, index)
        if self._last[0] != key:
            kept = ".".join(leaf.path) in self.fp8_leaves
            pair = self.raw_fp8(leaf, index) if kept else fp8.quantize(self.hf_float(leaf, index), pow2=self.pow2)
            self._last = (key, pair)
        return self._last[1]

    def hf_float(self, leaf: hf_names.Leaf, index) -> np.ndarray:
        """The HF tensor of the slice at `index`, as float (fp32 for FP8-kept leaves)."""
        if ".".join(leaf.path) in self.fp8_leaves:
            return fp8.dequantize(*self.raw_fp8(leaf, index))
        return slice_to_hf(leaf, self.params.read(leaf.path, index))


def _plan(cfg: ModelConfig, meta: dict, src: _Source, want_fp8: bool, dtype: np.dtype | None) -> list[_Tensor]:
    source = meta.get("source", {})
    dtypes, exceptions = source.get("dtypes", {}), source.get("dtype_exceptions", {})
    stored = np.dtype(jnp.dtype(cfg.param_dtype))
    out = []
    for leaf in hf_names.leaves(cfg):
        key, shape = ".".join(leaf.path), tuple(leaf.hf_shapes()[0])
        for index, (name,) in leaf_slices(leaf):  # one HF tensor a slice (routed experts: one expert)
            if want_fp8 and fp8.quantizable(name):
                out += [_Tensor(name, fp8.E4M3, shape, lambda leaf=leaf, index=index: src.fp8_pair(leaf, index)[0]),
                        _Tensor(scale_name(name), np.dtype(np.float32), fp8.scale_shape(shape),
                                lambda leaf=leaf, index=index: src.fp8_pair(leaf, index)[1])]
                continue
            recorded = exceptions.get(name, dtypes.get(key))
            if dtype is not None:
                dt = dtype
            elif recorded == "float8_e4m3fn":  # an FP8 source written out unquantised
                dt = np.dtype(ml_dtypes.bfloat16)
            else:
                dt = np.dtype(jnp.dtype(recorded)) if recorded else stored
            out.append(_Tensor(name, dt, shape,
                               lambda leaf=leaf, index=index, dt=dt: src.hf_float(leaf, index).astype(dt)))
    if source.get("mtp_shared_copies", True):  # each MTP layer's copies of the embedding and head
        by_name = {t.name: t for t in out}
        out += [dataclasses.replace(by_name[m], name=c)
                for c, m in hf_names.mtp_shared_copies(cfg) if m in by_name]
    return out


def _assign_shards(tensors: list[_Tensor], recorded: dict[str, str] | None, shard_bytes: int) -> dict[str, str]:
    """The source's own shard names when the tensor names are the same, else greedy by size."""
    names = {t.name for t in tensors}
    if recorded and set(recorded) == names:
        return dict(recorded)
    groups: list[list[str]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.dtype.itemsize * int(np.prod(t.shape, dtype=np.int64))
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t.name)
        size += nbytes
    if len(groups) == 1:
        return {n: "model.safetensors" for n in groups[0]}
    n = len(groups)
    return {name: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, g in enumerate(groups) for name in g}


def hf_config(cfg: ModelConfig, dtype: np.dtype, fp8_out: bool) -> dict:
    out = cfg.to_hf_config()
    out["torch_dtype"] = out["dtype"] = {"float32": "float32", "float16": "float16"}.get(dtype.name, "bfloat16")
    if fp8_out:
        out["quantization_config"] = cfg.hf_quantization_config()
    return out


def convert_orbax_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike, **kw) -> dict:
    """Writes HF folder `out` from our Orbax checkpoint `ckpt` (options: `write_hf`). Returns a summary dict."""
    root = os.path.abspath(os.fspath(ckpt))
    if not orbax_layout.is_orbax_checkpoint(root):
        raise CheckpointError(f"{root} is not an Orbax checkpoint written by `python -m dsv3_jax.convert`")
    meta = orbax_layout.read_meta(root)
    params = orbax_layout.ItemReader(root, orbax_layout.PARAMS)
    if os.path.isfile(os.path.join(root, "tokenizer.json")):  # kept by the HF -> Orbax conversion
        kw.setdefault("tokenizer", os.path.join(root, "tokenizer.json"))
    return write_hf(meta, params, out, fp8_reader=orbax_layout.ItemReader(root, orbax_layout.FP8), **kw)


def write_hf(meta: dict, params, out: str | os.PathLike, *, fp8_reader: orbax_layout.ItemReader | None = None,
             fp8_out: bool = False, dtype=None, shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True,
             overwrite: bool = False, tokenizer=None, chat_template_file=None) -> dict:
    """Writes HF folder `out` from parameters read slice by slice: `meta` as in our checkpoint's
    config/metadata (model config, fp8_leaves, source), `params.read(path, index)` one [layer] or
    [layer, expert] slice of a parameter, `fp8_reader` the kept-FP8 item if any. With `tokenizer`
    (a tokenizer.json) the folder gets the tokenizer files, generation_config.json and the special
    token ids in config.json (`hf_tokenizer.write_tokenizer_files`; `chat_template_file` overrides
    the tokenizer's chat template)."""
    out = os.path.abspath(os.fspath(out))
    tmp = begin_output(out, overwrite)
    cfg = ModelConfig.from_dict(meta["model"])
    want = np.dtype(jnp.dtype(dtype)) if dtype is not None else None
    src = _Source(params, fp8_reader, meta)
    tensors = sorted(_plan(cfg, meta, src, fp8_out, want), key=lambda t: _layer_of(t.name))  # stable sort
    source = meta.get("source", {})
    weight_map = _assign_shards(tensors, source.get("weight_map"), shard_bytes)
    by_shard: dict[str, list[_Tensor]] = {}
    for t in tensors:
        by_shard.setdefault(weight_map[t.name], []).append(t)
    total = sum(t.dtype.itemsize * int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
    main_dtype = want or np.dtype(jnp.dtype(source.get("dtypes", {}).get("embed", cfg.param_dtype)))
    try:
        os.makedirs(tmp)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"Orbax -> {os.path.basename(out)}",
                  disable=not progress, smoothing=0.1) as bar:
            for shard in sorted(by_shard):
                group = by_shard[shard]
                writer = ShardWriter(os.path.join(tmp, shard), [(t.name, t.dtype, t.shape) for t in group],
                                     metadata={"format": "pt"})
                try:
                    for t in group:
                        value = t.make()
                        writer.write(t.name, np.asarray(value, t.dtype).reshape(t.shape))
                        bar.update(value.nbytes)
                except BaseException:
                    writer.close(check=False)
                    raise
                writer.close()
        if len(by_shard) > 1 or "model.safetensors" not in by_shard:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        config = hf_config(cfg, main_dtype, fp8_out)
        if tokenizer is not None:
            config.update(hf_tokenizer.write_tokenizer_files(
                tokenizer, tmp, model_max_length=cfg.max_position_embeddings, chat_template_file=chat_template_file,
                generation=source.get("generation_config")))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "tensors": len(tensors), "shards": len(by_shard), "bytes": total}


def export_run(run: run_folder.RunStep, out: str, **convert_kw) -> dict:
    """HF folder `out` (config.json, safetensors, the run's tokenizer with its chat template and
    generation_config.json: `hf_tokenizer.write_tokenizer_files`) from a run's step.

    The converter's own writer (`orbax_to_hf.write_hf`: HF names, shards, FP8 option) reads the
    step's train state one [layer] or [layer, expert] slice at a time (`run_folder.StateParams`), so
    the export holds one HF tensor at a time, never the model or a whole stacked leaf.
    """
    state = run_folder.StateParams(run)
    state.check()
    meta = {"model": run.model_config().to_dict(), "fp8_leaves": [], "source": {"run": run.run_dir, "step": run.step}}
    template = run.config().get("data", {}).get("chat_template")  # an SFT run's own template, when it set one
    params = lora_export.merged_params(run, state)  # LoRA runs: merged
    summary = write_hf(meta, params, out, tokenizer=run.tokenizer or BUNDLED_PATH, chat_template_file=template,
                       **convert_kw)
    return {**summary, "step": run.step}

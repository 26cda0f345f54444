"""HF DeepSeek-V3 folder (bf16, fp32 or the released FP8) -> our Orbax checkpoint, streamed.

1. Plan: every parameter of `DeepSeekV3(cfg)` is matched with its HF tensors from the shard
   headers alone (`hf_names.leaves`); any missing, unexpected, misshaped or wrongly typed tensor
   fails here, before a byte is written, with the tensor and file named.
2. Write: one slice at a time ([layer] or [layer, expert]), each HF tensor memory-mapped on its
   own and unmapped after use, written into the Orbax arrays with tensorstore. Resident memory is
   one slice (plus bounded write-behind), however many layers there are.
3. Commit: everything goes to `OUT.orbax-checkpoint-tmp-PID`; the config that makes it a
   checkpoint is written last and the folder renamed into place only when complete (and, with
   `verify`, re-read). Any error or interrupt removes the temporary folder.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dsv3_jax.checkpoint import fp8, hf_names, orbax_layout
from dsv3_jax.checkpoint.safetensors_io import CheckpointError, HFCheckpoint
from dsv3_jax.config import ModelConfig
from dsv3_jax.model import DeepSeekV3

_FLOATS = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}
_ROW_BLOCK_BYTES = 64 << 20
# Unstacked [V, D] tensors converted in row blocks: HF rows -> our rows (embed) or columns (head).
_ROW_CHUNKED = {("embed",): False, ("head",): True}


@dataclasses.dataclass
class LeafPlan:
    leaf: hf_names.Leaf
    shape: tuple[int, ...]  # ours
    dtype: np.dtype  # ours
    slices: list[tuple[tuple[int, ...], list[str]]]  # (index into our array, HF names of that slice)
    fp8: bool  # every HF tensor is e4m3 + scale and --keep-fp8: stored as such in the `fp8` item
    source_dtype: str
    nbytes: int  # HF bytes read, scales included

    @property
    def key(self) -> str:
        return ".".join(self.leaf.path)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return self.shape[:len(self.slices[0][0])]


def model_variables(cfg: ModelConfig) -> dict[tuple[str, ...], nnx.Variable]:
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    return {tuple(str(p) for p in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Variable)}


def leaf_slices(leaf: hf_names.Leaf) -> list[tuple[tuple[int, ...], list[str]]]:
    """(our index, HF names) per slice: () unstacked, (layer,) stacked, (layer, expert) for experts."""
    if leaf.hf_layers is None:
        return [((), leaf.hf(None))]
    out = []
    for i, layer in enumerate(leaf.hf_layers):
        names = leaf.hf(layer)
        if len(leaf.hf_shapes()) > 1:  # routed experts: one slice per expert
            out.extend(((i, j), [n]) for j, n in enumerate(names))
        else:
            out.append(((i,), names))
    return out


def slice_to_ours(leaf: hf_names.Leaf, index: tuple[int, ...], xs: list[np.ndarray]) -> np.ndarray:
    part = leaf.to_ours(xs)
    return part[0] if len(index) == 2 else part


def slice_to_hf(leaf: hf_names.Leaf, index: tuple[int, ...], x: np.ndarray) -> list[np.ndarray]:
    return leaf.to_hf(x[None]) if len(index) == 2 else leaf.to_hf(x)


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".weight_scale_inv"


class _Checker:
    """Header-only checks of HF tensors against the shapes the config needs."""

    def __init__(self, ckpt: HFCheckpoint, config_path: str):
        self.ckpt, self.config_path, self.used = ckpt, config_path, set()
        index = os.path.join(ckpt.folder, "model.safetensors.index.json")
        self.listing = index if os.path.exists(index) else os.path.join(ckpt.folder, "model.safetensors")

    def check(self, name: str, shape: tuple[int, ...]) -> tuple[np.dtype, bool, int]:
        """-> (stored dtype, is fp8, bytes including the scale)."""
        if name not in self.ckpt:
            raise CheckpointError(f"tensor {name} is missing: {self.listing} does not list it, and "
                                  f"{self.config_path} needs it")
        got, dtype, nbytes = self.ckpt.header(name)
        where = self.ckpt.where(name)
        self.used.add(name)
        if tuple(got) != tuple(shape):
            raise CheckpointError(f"tensor {name} in {where} has shape {tuple(got)}, but {self.config_path} "
                                  f"needs {tuple(shape)}")
        if dtype == fp8.E4M3:
            scale = _scale_name(name)
            if scale not in self.ckpt:
                raise CheckpointError(f"FP8 tensor {name} in {where} has no {scale} ({self.listing} lacks it)")
            s_shape, s_dtype, s_bytes = self.ckpt.header(scale)
            self.used.add(scale)
            if tuple(s_shape) != fp8.scale_shape(shape):
                raise CheckpointError(f"tensor {scale} in {self.ckpt.where(scale)} has shape {tuple(s_shape)}, "
                                      f"expected {fp8.scale_shape(shape)} for {name} {tuple(shape)}")
            if s_dtype != np.float32:
                raise CheckpointError(f"tensor {scale} in {self.ckpt.where(scale)} has dtype {s_dtype}, "
                                      "expected float32 block scales")
            return dtype, True, nbytes + s_bytes
        if dtype not in _FLOATS:
            raise CheckpointError(f"tensor {name} in {where} has dtype {dtype}; expected float32, bfloat16, "
                                  "float16 or float8_e4m3fn (with weight_scale_inv)")
        return dtype, False, nbytes


def plan(ckpt: HFCheckpoint, cfg: ModelConfig, config_path: str, keep_fp8: bool
         ) -> tuple[list[LeafPlan], _Checker, dict[str, str]]:
    """Matches every parameter with its HF tensors; raises on any mismatch. Also returns
    {hf name: dtype} for tensors whose dtype differs from the rest of their parameter."""
    variables = model_variables(cfg)
    checker = _Checker(ckpt, config_path)
    plans, exceptions = [], {}
    for leaf in hf_names.leaves(cfg):
        var = variables[leaf.path]
        slices = leaf_slices(leaf)
        shape = leaf.hf_shapes()[0]  # experts: E equal shapes
        infos = {n: checker.check(n, shape) for _, names in slices for n in names}
        dtypes = [str(d) for d, _, _ in infos.values()]
        common = max(set(dtypes), key=dtypes.count)
        exceptions.update({n: str(d) for n, (d, _, _) in infos.items() if str(d) != common})
        is_fp8 = [f for _, f, _ in infos.values()]
        if keep_fp8 and any(is_fp8) and not all(is_fp8):
            bad = next(n for n, (_, f, _) in infos.items() if not f)
            raise CheckpointError(f"--keep-fp8: tensor {bad} in {ckpt.where(bad)} is {infos[bad][0]} while "
                                  f"other slices of {'.'.join(leaf.path)} are FP8; convert without --keep-fp8")
        plans.append(LeafPlan(leaf, tuple(var.shape), np.dtype(jnp.dtype(var.dtype)), slices,
                              keep_fp8 and all(is_fp8), common, sum(b for _, _, b in infos.values())))
    return plans, checker, exceptions


def _read(ckpt: HFCheckpoint, name: str, dtype: np.dtype) -> np.ndarray:
    x = ckpt.read(name)
    if x.dtype == fp8.E4M3:
        return fp8.dequantize(x, ckpt.read(_scale_name(name))).astype(dtype)
    return x.astype(dtype)


def _row_step(row_bytes: int) -> int:
    return max(1, _ROW_BLOCK_BYTES // max(row_bytes, 1))


def _row_blocks(rows: int, row_bytes: int):
    step = _row_step(row_bytes)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _write_leaf(ckpt: HFCheckpoint, p: LeafPlan, params: orbax_layout.ItemWriter,
                fp8_item: orbax_layout.ItemWriter | None, bar) -> None:
    if p.fp8:
        names0 = p.slices[0][1]
        hf_shape = ckpt.header(names0[0])[0]
        k = len(p.stack_shape)
        q_arr = fp8_item.create(p.leaf.path + ("qvalue",), p.stack_shape + tuple(hf_shape), fp8.E4M3, stacked=k)
        s_arr = fp8_item.create(p.leaf.path + ("scale_inv",), p.stack_shape + fp8.scale_shape(hf_shape),
                                np.float32, stacked=k)
        for index, (name,) in p.slices:
            q, s = ckpt.read(name), ckpt.read(_scale_name(name))
            fp8_item.write(q_arr[index] if index else q_arr, np.array(q))
            fp8_item.write(s_arr[index] if index else s_arr, np.array(s))
            bar.update(q.nbytes + s.nbytes)
        return
    if p.leaf.path in _ROW_CHUNKED and ckpt.header(p.slices[0][1][0])[1] != fp8.E4M3:
        name, transposed = p.slices[0][1][0], _ROW_CHUNKED[p.leaf.path]
        rows, cols = ckpt.header(name)[0]
        step = _row_step(cols * 4)
        arr = params.create(p.leaf.path, p.shape, p.dtype, chunks=[cols, step] if transposed else [step, cols])
        for r0, r1 in _row_blocks(rows, cols * 4):
            x = ckpt.read_rows(name, r0, r1)
            params.write(arr[:, r0:r1] if transposed else arr[r0:r1], (x.T if transposed else x).astype(p.dtype))
            bar.update(x.nbytes)
        return
    arr = params.create(p.leaf.path, p.shape, p.dtype, stacked=len(p.slices[0][0]))
    for index, names in p.slices:
        xs = [_read(ckpt, n, p.dtype) for n in names]
        params.write(arr[index] if index else arr, slice_to_ours(p.leaf, index, xs))
        bar.update(sum(ckpt.header(n)[2] for n in names)
                   + sum(ckpt.header(_scale_name(n))[2] for n in names if ckpt.header(n)[1] == fp8.E4M3))


def _compare_copies(ckpt: HFCheckpoint, cfg: ModelConfig, checker: _Checker, bar) -> bool:
    """MTP layers store the embedding and head again; warn where they differ from the main ones."""
    present = False
    for copy, main in hf_names.mtp_shared_copies(cfg):
        if copy not in ckpt:
            continue
        present = True
        shape = ckpt.header(main)[0]
        checker.check(copy, shape)
        same = True
        for r0, r1 in _row_blocks(shape[0], int(np.prod(shape[1:])) * 4):
            a, b = ckpt.read_rows(copy, r0, r1), ckpt.read_rows(main, r0, r1)
            same = same and np.array_equal(a.astype(np.float32), b.astype(np.float32))
            bar.update(a.nbytes + b.nbytes)
        if not same:
            logging.warning("%s (%s) differs from %s; the MTP module uses the main model's copy",
                            copy, ckpt.where(copy), main)
    return present


def _verify(ckpt: HFCheckpoint, plans: list[LeafPlan], root: str, samples: int) -> int:
    """Re-reads `samples` slices (first, last and random ones) from the written arrays and compares
    them bit for bit with a fresh conversion of the source."""
    tasks = [(p, index, names) for p in plans for index, names in p.slices]
    rng = np.random.default_rng(0)
    pick = sorted({0, len(tasks) - 1, *rng.choice(len(tasks), min(samples, len(tasks)), replace=False).tolist()})
    readers = {item: orbax_layout.ItemReader(root, item) for item in (orbax_layout.PARAMS, orbax_layout.FP8)}
    for t in pick[:max(samples, 1)]:
        p, index, names = tasks[t]
        if p.fp8:
            got = [readers[orbax_layout.FP8].read(p.leaf.path + (k,), index) for k in ("qvalue", "scale_inv")]
            want = [np.asarray(ckpt.read(names[0])), np.asarray(ckpt.read(_scale_name(names[0])))]
        else:
            got = [readers[orbax_layout.PARAMS].read(p.leaf.path, index)]
            want = [slice_to_ours(p.leaf, index, [_read(ckpt, n, p.dtype) for n in names]).astype(p.dtype)]
        for g, w in zip(got, want):
            if g.shape != w.shape or g.tobytes() != w.tobytes():
                raise CheckpointError(f"--verify: {p.key}{list(index)} in {root} differs from "
                                      f"{names[0]} in {ckpt.where(names[0])}")
    return len(pick[:max(samples, 1)])


def _tmp_path(out: str) -> str:
    for stale in glob.glob(glob.escape(out) + ".orbax-checkpoint-tmp-*"):
        pid = stale.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed conversion
    return f"{out}.orbax-checkpoint-tmp-{os.getpid()}"


def commit(tmp: str, out: str, overwrite: bool) -> None:
    if os.path.exists(out):
        if not overwrite:
            raise CheckpointError(f"{out} already exists; remove it or pass --overwrite")
        old = f"{out}.orbax-checkpoint-tmp-old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def convert_hf_to_orbax(hf_dir: str | os.PathLike, out: str | os.PathLike, *, dtype=None, keep_fp8: bool = False,
                        verify: int = 0, progress: bool = True, overwrite: bool = False) -> dict:
    """Writes the Orbax checkpoint of HF folder `hf_dir` at `out`. Returns a summary dict."""
    hf_dir, out = os.fspath(hf_dir), os.path.abspath(os.fspath(out))
    if os.path.exists(out) and not overwrite:
        raise CheckpointError(f"{out} already exists; remove it or pass --overwrite")
    ckpt = HFCheckpoint(hf_dir)
    config_path = os.path.join(hf_dir, "config.json")
    cfg = ModelConfig.from_hf_config(config_path)
    if cfg.num_mtp_layers and not any(n.startswith(f"model.layers.{cfg.num_layers}.") for n in ckpt.names()):
        logging.warning("%s has %d MTP layer(s) but %s has no MTP tensors; converting without MTP",
                        config_path, cfg.num_mtp_layers, hf_dir)
        cfg = cfg.replace(num_mtp_layers=0)
    if dtype is not None:
        pdtype = np.dtype(jnp.dtype(dtype))
    else:
        emb = ckpt.header("model.embed_tokens.weight")[1] if "model.embed_tokens.weight" in ckpt else fp8.E4M3
        pdtype = np.dtype(ml_dtypes.bfloat16) if emb == fp8.E4M3 else np.dtype(emb)
    cfg = cfg.replace(param_dtype=pdtype.name, compute_dtype=pdtype.name)
    plans, checker, exceptions = plan(ckpt, cfg, config_path, keep_fp8)
    copies = [c for c, _ in hf_names.mtp_shared_copies(cfg) if c in ckpt]
    for c in copies:
        checker.used.add(c)
    extra = sorted(set(ckpt.names()) - checker.used)
    if extra:
        shown = ", ".join(f"{n} ({ckpt.where(n)})" for n in extra[:5])
        raise CheckpointError(f"{len(extra)} unexpected tensor(s) that {config_path} does not use: "
                              f"{shown}{' ...' if len(extra) > 5 else ''}")
    total = sum(p.nbytes for p in plans) + 2 * sum(ckpt.header(c)[2] for c in copies)
    tmp = _tmp_path(out)
    try:
        params = orbax_layout.ItemWriter(os.path.join(tmp, orbax_layout.PARAMS))
        fp8_item = orbax_layout.ItemWriter(os.path.join(tmp, orbax_layout.FP8)) if any(p.fp8 for p in plans) else None
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"{os.path.basename(hf_dir)} -> Orbax",
                  disable=not progress, smoothing=0.1) as bar:
            for p in plans:
                bar.set_postfix_str(p.key, refresh=False)
                _write_leaf(ckpt, p, params, fp8_item, bar)
            mtp_copies = _compare_copies(ckpt, cfg, checker, bar)
        items = [orbax_layout.PARAMS]
        params.finish()
        if fp8_item is not None:
            fp8_item.finish()
            items.append(orbax_layout.FP8)
        verified = _verify(ckpt, plans, tmp, verify) if verify else 0
        os.sync()  # the chunk files were written without fsync
        source = {"hf_dir": os.path.abspath(hf_dir), "dtypes": {p.key: p.source_dtype for p in plans},
                  "dtype_exceptions": exceptions, "weight_map": ckpt.weight_map, "mtp_shared_copies": mtp_copies,
                  "hf_config": _read_json(config_path)}
        orbax_layout.write_config(tmp, {"model": cfg.to_dict(), "fp8_leaves": [p.key for p in plans if p.fp8],
                                        "source": source}, items)
        commit(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "bytes_read": total, "verified": verified, "fp8_leaves": sum(p.fp8 for p in plans)}


def _read_json(path: str) -> dict:
    import json

    with open(path) as f:
        return json.load(f)

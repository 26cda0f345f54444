"""HF DeepSeek-V3 folder (bf16, fp32 or the released FP8) -> our Orbax checkpoint, streamed.

1. Plan: every parameter of `DeepSeekV3(cfg)` is matched with its HF tensors from the shard
   headers alone (`HFReader.check_all`); any missing, unexpected, misshaped or wrongly typed
   tensor fails here, before a byte is written, with the tensor and file named.
2. Write: each parameter in blocks of at most CHUNK_BYTES (`regions`): the stacked dims ([layer],
   [layer, expert]) one index at a time and the dimension HF rows run along cut into row blocks,
   so every block reads contiguous rows of one memory-mapped HF tensor (`hf_reader.read_shard`).
   Each block is one chunk of the Orbax (zarr) array, written with tensorstore. Resident memory is
   a few blocks plus bounded write-behind for any leaf, the 129280 x 7168 embedding and head
   included, in any output dtype.
3. Commit: everything goes to `OUT.orbax-checkpoint-tmp-PID`; the config that makes it a
   checkpoint is written last and the folder renamed into place only when complete (and, with
   `verify`, sampled blocks re-read and compared), with the arrays' checksums (`integrity`, summed
   block by block as written) for `load_pretrained` to check. Any error or interrupt removes the folder.
   `--overwrite` keeps the old output as `OUT.replaced` until the new one is in place; a run
   killed in between leaves it there, and the next run puts it back (`begin_output`).

`quantize` ("fp8" | "int8" | "int4", dsv3_jax/ops/quant.py) stores the projections `quant_targets`
names quantized, block by block as the rest: "fp8" in the `fp8` item (e4m3 + 128x128 scale_inv,
HF orientation; FP8 sources copied as stored, others quantized per 128-row block), "int8"/"int4"
in `params` as {"q", "scale"} under the parameter's path, [*stack, K(/2), N] and [*stack, K/g, N],
quantized per block of whole groups. The config's `quant` section names the leaves, format and group;
`load_pretrained` loads such a checkpoint quantized by default.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import itertools
import json
import math
import os
import pathlib
import shutil
from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dsv3_jax.checkpoint import fp8, hf_names, hf_tokenizer, orbax_layout, quantized
from dsv3_jax.checkpoint.hf_reader import HFReader, read_shard
from dsv3_jax.checkpoint.hf_names import leaf_slices
from dsv3_jax.checkpoint.load import abstract_model
from dsv3_jax.checkpoint.safetensors_io import CheckpointError
from dsv3_jax.config import ModelConfig
from dsv3_jax.model import quant as model_quant
from dsv3_jax.ops import quant

CHUNK_BYTES = 32 << 20  # one written block (and one Orbax chunk file), in the output dtype


@dataclasses.dataclass
class LeafPlan:
    leaf: hf_names.Leaf
    shape: tuple[int, ...]  # ours
    dtype: np.dtype  # ours
    fp8: bool  # stored in the `fp8` item: e4m3 HF tensors with --keep-fp8, or --quantize=fp8 targets
    source_dtype: str
    nbytes: int  # HF bytes read, scales included
    hf_shape: tuple[int, ...]  # one HF tensor
    fp8_stored: bool = True  # with fp8: the source is e4m3 (copied), else quantized per block
    quant: str | None = None  # "int8" | "int4": stored as {"q", "scale"} in `params`
    group: int = 0  # int formats: rows of K per scale

    @property
    def key(self) -> str:
        return ".".join(self.leaf.path)

    @property
    def stacked(self) -> int:
        return hf_names.stacked_dims(self.leaf)


def plan(reader: HFReader, cfg: ModelConfig, keep_fp8: bool, quantize: str | None = None,
         quant_targets: str | None = None, quant_group: int = 128) -> tuple[list[LeafPlan], dict[str, str]]:
    """Matches every parameter with its HF tensors; raises on any mismatch. Also returns
    {hf name: dtype} for tensors whose dtype differs from the rest of their parameter."""
    model, variables = abstract_model(cfg)
    targets = set()  # the paths stored quantized
    if quantize is not None:
        quant.check_format(quantize, "--quantize")
        which = model_quant.check_targets(quant_targets or model_quant.default_targets(quantize))
        targets = {path for path, *_ in model_quant.targets(model, which)}
    infos = reader.check_all(cfg)
    plans, exceptions = [], {}
    for leaf in hf_names.leaves(cfg):
        var = variables[leaf.path]
        mine = {n: infos[n] for _, names in leaf_slices(leaf) for n in names}
        dtypes = [str(i.dtype) for i in mine.values()]
        common = max(set(dtypes), key=dtypes.count)
        exceptions.update({n: str(i.dtype) for n, i in mine.items() if str(i.dtype) != common})
        is_fp8 = [i.fp8 for i in mine.values()]
        if keep_fp8 and any(is_fp8) and not all(is_fp8):
            bad = next(n for n, i in mine.items() if not i.fp8)
            raise CheckpointError(f"--keep-fp8: tensor {bad} in {reader.ckpt.where(bad)} is {mine[bad].dtype} while "
                                  f"other slices of {'.'.join(leaf.path)} are FP8; convert without --keep-fp8")
        lp = LeafPlan(leaf, tuple(var.shape), np.dtype(jnp.dtype(var.dtype)), keep_fp8 and all(is_fp8),
                      common, sum(i.nbytes for i in mine.values()), tuple(leaf.hf_shapes()[0]))
        if leaf.path in targets and quantize == "fp8":
            lp = dataclasses.replace(lp, fp8=True, fp8_stored=all(is_fp8))
        elif leaf.path in targets:
            k = lp.hf_shape[1]
            lp = dataclasses.replace(lp, fp8=False, quant=quantize,
                                     group=quant.group_for(k, quant_group, quantize, lp.key))
        plans.append(lp)
    return plans, exceptions


def _row_dim(p: LeafPlan) -> int:
    """Our dimension that the HF tensor's rows run along (the outer dim of its row group)."""
    groups, d = [], p.stacked
    for n in p.leaf.layout.split:
        groups.append(d)
        d += n
    return groups[-1] if p.leaf.layout.transposed else groups[0]


def regions(p: LeafPlan) -> tuple[list[int], list[tuple[slice, ...]]]:
    """(chunk shape, blocks) of our array: blocks of at most CHUNK_BYTES that each read a
    contiguous run of HF rows, aligned with the Orbax chunks so no write touches another's chunk."""
    cut = _row_dim(p)
    per_unit = math.prod(p.shape[p.stacked:]) // p.shape[cut] * p.dtype.itemsize
    chunks = [1] * p.stacked + list(p.shape[p.stacked:])
    chunks[cut] = min(p.shape[cut], max(1, CHUNK_BYTES // max(per_unit, 1)))
    return chunks, _grid(p.shape, chunks)


def _grid(shape: tuple[int, ...], chunks: list[int]) -> list[tuple[slice, ...]]:
    """The blocks of an array of `shape` cut into `chunks`, in C order: one chunk file each."""
    return [tuple(slice(i, min(n, i + c)) for i, n, c in zip(corner, shape, chunks))
            for corner in itertools.product(*(range(0, n, c) for n, c in zip(shape, chunks)))]


def fp8_regions(p: LeafPlan) -> tuple[list[int], list[tuple[slice, ...]]]:
    """Row blocks (multiples of the 128-row scale block) of the e4m3 tensors, HF orientation."""
    rows, cols = p.hf_shape
    chunks = [1] * p.stacked + [min(rows, max(fp8.BLOCK, CHUNK_BYTES // cols // fp8.BLOCK * fp8.BLOCK)), cols]
    return chunks, _grid(p.shape[:p.stacked] + p.hf_shape, chunks)


class _Array(NamedTuple):
    item: str  # orbax_layout.PARAMS or FP8
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: list[int]
    block: Callable[[tuple[slice, ...]], np.ndarray]  # index -> that block of the array


def _arrays(reader: HFReader, p: LeafPlan) -> list[_Array]:
    """What leaf `p` is stored as: its array in `params`, or the q and scale of its quantized form,
    blocks of whole scale rows (`quantized.Blocks`, the loader's arithmetic): e4m3 [*stack, N, K]
    and `scale_inv` in the `fp8` item (FP8 sources copied as stored), or int {"q", "scale"} in
    `params` ([*stack, K(/2), N], [*stack, K/g, N])."""
    if not p.fp8 and p.quant is None:
        chunks, _ = regions(p)
        window = reader.leaf_window(p.leaf, p.dtype)
        return [_Array(orbax_layout.PARAMS, p.leaf.path, p.shape, p.dtype, chunks,
                       lambda index: read_shard(p.leaf, p.shape, index, window, p.dtype))]
    n, k = p.hf_shape
    if p.fp8:
        fmt, g, item, names = "fp8", fp8.BLOCK, orbax_layout.FP8, ("qvalue", "scale_inv")
        step = fp8_regions(p)[0][-2]  # N rows per block
        rows = (step, -(-step // fp8.BLOCK))
    else:
        fmt, g, item, names = p.quant, p.group, orbax_layout.PARAMS, ("q", "scale")
        step = min(k, max(g, CHUNK_BYTES // (4 * n) // g * g))  # K rows per block, whole groups
        rows = (step // 2 if fmt == "int4" else step, step // g)
    raw = reader.raw_fp8(p.leaf) if p.fp8 and p.fp8_stored else None
    blocks = quantized.Blocks(fmt, g, p.stacked, k, n, quantized.hf_2d(reader.leaf_window(p.leaf, np.float32)), raw,
                              pow2=reader.scale_fmt == "ue8m0")
    shapes = quant.physical_shapes(fmt, p.shape[:p.stacked], k, n, g)
    return [_Array(item, p.leaf.path + (name,), shape, np.dtype(dtype), [1] * p.stacked + [r, shape[-1]],
                   functools.partial(blocks, part, shape))
            for part, name, r, (shape, dtype) in zip(("q", "scale"), names, rows, shapes)]


def _write_leaf(reader: HFReader, p: LeafPlan, items: dict[str, orbax_layout.ItemWriter], bar) -> None:
    """Leaf `p` written chunk by chunk; a quantized leaf's q and scale blocks of the same rows together."""
    arrays = _arrays(reader, p)
    stores = [items[a.item].create(a.path, a.shape, a.dtype, chunks=a.chunks) for a in arrays]
    for indices in zip(*(_grid(a.shape, a.chunks) for a in arrays)):
        before = reader.bytes_read
        for a, store, index in zip(arrays, stores, indices):
            items[a.item].write(store[index], a.block(index))
        bar.update(reader.bytes_read - before)


def _verify(reader: HFReader, plans: list[LeafPlan], root: str, samples: int) -> int:
    """Re-reads `samples` blocks (first, last and random ones) from the written arrays and compares
    them bit for bit with a fresh conversion of the same block of the source: only those blocks
    are read, on both sides."""
    tasks = [(a, index) for p in plans for a in _arrays(reader, p) for index in _grid(a.shape, a.chunks)]
    rng = np.random.default_rng(0)
    pick = sorted({0, len(tasks) - 1, *rng.choice(len(tasks), min(samples, len(tasks)), replace=False).tolist()})
    pick = pick[:max(samples, 1)]
    readers = {item: orbax_layout.ItemReader(root, item) for item in (orbax_layout.PARAMS, orbax_layout.FP8)}
    for t in pick:
        a, index = tasks[t]
        got, want = readers[a.item].read(a.path, index), a.block(index)
        if got.shape != want.shape or got.tobytes() != want.tobytes():
            raise CheckpointError(f"--verify: {'.'.join(a.path)}[{', '.join(f'{s.start}:{s.stop}' for s in index)}] "
                                  f"in {root} differs from its source in {reader.folder}")
    return len(pick)


REPLACED = ".replaced"  # `commit` keeps the old output here; no cleanup of temporary folders matches it


def begin_output(out: str, overwrite: bool) -> str:
    """The temporary folder to build `out` in (`commit` renames it into place). First it mends what
    a killed run left: the old output `commit` set aside comes back unless the new one replaced it,
    and dead runs' temporary folders go. Refuses an existing `out` unless `overwrite`."""
    if os.path.exists(out + REPLACED):
        if os.path.exists(out):
            shutil.rmtree(out + REPLACED)  # killed after the new output was in place
        else:
            os.rename(out + REPLACED, out)  # killed between commit's two renames
    if os.path.exists(out) and not overwrite:
        raise CheckpointError(f"{out} already exists; remove it or pass --overwrite")
    for stale in glob.glob(glob.escape(out) + ".orbax-checkpoint-tmp-*"):
        pid = stale.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed conversion
    return f"{out}.orbax-checkpoint-tmp-{os.getpid()}"


def commit(tmp: str, out: str) -> None:
    """Renames `tmp` to `out`; an existing `out` (`begin_output` let it stand: --overwrite) stays
    as `out + REPLACED` until then."""
    if os.path.exists(out):
        os.rename(out, out + REPLACED)
    os.rename(tmp, out)
    shutil.rmtree(out + REPLACED, ignore_errors=True)


def convert_hf_to_orbax(hf_dir: str | os.PathLike, out: str | os.PathLike, *, dtype=None, keep_fp8: bool = False,
                        verify: int = 0, progress: bool = True, overwrite: bool = False, quantize: str | None = None,
                        quant_targets: str | None = None, quant_group: int = 128) -> dict:
    """Writes the Orbax checkpoint of HF folder `hf_dir` at `out`. Returns a summary dict."""
    hf_dir, out = os.fspath(hf_dir), os.path.abspath(os.fspath(out))
    tmp = begin_output(out, overwrite)
    reader = HFReader(hf_dir)
    pdtype = np.dtype(jnp.dtype(dtype)) if dtype is not None else reader.stored_dtype()
    cfg = reader.config(param_dtype=pdtype.name, compute_dtype=pdtype.name)
    plans, exceptions = plan(reader, cfg, keep_fp8, quantize, quant_targets, quant_group)
    copies = reader.mtp_copies(cfg)
    total = sum(p.nbytes for p in plans) + 2 * sum(reader.ckpt.header(m)[2] for _, m in copies)
    try:
        items = [orbax_layout.PARAMS] + ([orbax_layout.FP8] if any(p.fp8 for p in plans) else [])
        writers = {item: orbax_layout.ItemWriter(os.path.join(tmp, item)) for item in items}
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"{os.path.basename(hf_dir)} -> Orbax",
                  disable=not progress, smoothing=0.1) as bar:
            for p in plans:
                bar.set_postfix_str(p.key, refresh=False)
                _write_leaf(reader, p, writers, bar)
            mtp_copies = reader.compare_mtp_copies(cfg, bar.update)
        for writer in writers.values():
            writer.finish()
        verified = _verify(reader, plans, tmp, verify) if verify else 0
        os.sync()  # the chunk files were written without fsync
        source = {"hf_dir": os.path.abspath(hf_dir), "dtypes": {p.key: p.source_dtype for p in plans},
                  "dtype_exceptions": exceptions, "weight_map": reader.ckpt.weight_map,
                  "mtp_shared_copies": mtp_copies, "hf_config": json.loads(pathlib.Path(reader.config_path).read_text()),
                  "generation_config": hf_tokenizer.source_generation_config(hf_dir)}
        hf_tokenizer.copy_tokenizer_files(hf_dir, tmp)  # the checkpoint carries its tokenizer to --to-hf and serve
        meta = {"model": cfg.to_dict(), "fp8_leaves": [p.key for p in plans if p.fp8], "source": source}
        if quantize is not None:
            meta["quant"] = {"format": quantize, "group": quant_group if quantize != "fp8" else fp8.BLOCK,
                             "leaves": [p.key for p in plans if p.quant is not None or (quantize == "fp8" and p.fp8)]}
        orbax_layout.write_config(tmp, meta, items, {item: writers[item].checksums if item in writers else {}
                                                     for item in (orbax_layout.PARAMS, orbax_layout.FP8)})
        commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "bytes_read": total, "verified": verified, "fp8_leaves": sum(p.fp8 for p in plans)}


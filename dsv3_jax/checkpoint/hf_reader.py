"""The one reader of HF DeepSeek-V3 folders, shared by the converter (`hf_to_orbax`) and the
loader (`load`).

- `config`: config.json as a ModelConfig; MTP layers the folder has no tensors for are dropped
  with a warning (transformers' re-saves omit them).
- `stored_dtype`: the embedding's dtype, bfloat16 for FP8 sources.
- `check_all`: header-only checks of every tensor the config needs (shape; dtype; for e4m3 the
  `weight_scale_inv` beside it, its block shape and float32 or float8_e8m0fnu dtype), of the MTP
  copies of the embedding and head, and that nothing else is in the folder. Errors name the
  tensor, its file and config.json. A V3.2 folder's indexer tensors are part of its config's model.
- `window`: rows x columns of one tensor read through a memory map of those rows only; FP8 is
  dequantised with just the scale blocks that cover the window (`scales`: as fp32, each checked
  to be a power of two when config.json says `scale_fmt: "ue8m0"`).
- `read_shard`: any shard of one of our parameters (the index a device holds) from windows of
  the HF-oriented tensors, so a process never builds more than the shards it places.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
from typing import Callable

import ml_dtypes
import numpy as np

from dsv3_jax.checkpoint import fp8, hf_names
from dsv3_jax.checkpoint.safetensors_io import CheckpointError, HFCheckpoint
from dsv3_jax.config import ModelConfig

FLOATS = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}
COMPARE_BLOCK_BYTES = 8 << 20  # rows of each MTP copy and its main tensor compared at once (float32)


def scale_name(name: str) -> str:
    """The released checkpoint's rule: `X.weight` in e4m3 has its block scales in `X.weight_scale_inv`."""
    return name[: -len(".weight")] + ".weight_scale_inv"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: np.dtype  # as stored
    fp8: bool  # e4m3 with a weight_scale_inv
    nbytes: int  # stored bytes, the scale included


class HFReader:
    """An HF folder (config.json + safetensors): checks, config and windowed reads. `bytes_read`
    counts the tensor bytes the windows touched (scales included)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.ckpt = HFCheckpoint(self.folder)
        self.config_path = os.path.join(self.folder, "config.json")
        self.bytes_read = 0
        self.scale_fmt = None  # config.json's, once `config` has read it

    def config(self, **overrides) -> ModelConfig:
        cfg = ModelConfig.from_hf_config(self.config_path)
        if cfg.num_mtp_layers and "num_mtp_layers" not in overrides and not self._has_mtp(cfg):
            logging.warning("%s has %d MTP layer(s) but %s has no MTP tensors; using it without MTP",
                            self.config_path, cfg.num_mtp_layers, self.folder)
            overrides["num_mtp_layers"] = 0
        self.scale_fmt = cfg.scale_fmt
        return cfg.replace(**overrides)

    def _has_mtp(self, cfg: ModelConfig) -> bool:
        prefix = f"model.layers.{cfg.num_layers}."
        return any(name.startswith(prefix) for name in self.ckpt.names())

    def stored_dtype(self) -> np.dtype:
        name = "model.embed_tokens.weight"
        dtype = self.ckpt.header(name)[1] if name in self.ckpt else fp8.E4M3
        return np.dtype(ml_dtypes.bfloat16) if dtype == fp8.E4M3 else np.dtype(dtype)

    def check(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        """Header checks of one tensor against the shape the config needs."""
        if name not in self.ckpt:
            raise CheckpointError(f"tensor {name} is missing from {self.folder}: {self.ckpt.listing} does not list "
                                  f"it, and {self.config_path} needs it")
        got, dtype, nbytes = self.ckpt.header(name)
        where = self.ckpt.where(name)
        if tuple(got) != tuple(shape):
            raise CheckpointError(f"tensor {name} in {where} has shape {tuple(got)}, the config needs "
                                  f"{tuple(shape)} ({self.config_path})")
        if dtype == fp8.E4M3:
            scale = scale_name(name)
            if scale not in self.ckpt:
                raise CheckpointError(f"FP8 tensor {name} in {where} has no {scale} ({self.ckpt.listing} lacks it)")
            s_shape, s_dtype, s_bytes = self.ckpt.header(scale)
            if tuple(s_shape) != fp8.scale_shape(shape):
                raise CheckpointError(f"tensor {scale} in {self.ckpt.where(scale)} has shape {tuple(s_shape)}, "
                                      f"expected {fp8.scale_shape(shape)} for {name} {tuple(shape)}")
            if s_dtype not in fp8.SCALE_DTYPES:
                raise CheckpointError(f"tensor {scale} in {self.ckpt.where(scale)} has dtype {s_dtype}, "
                                      "expected float32 or float8_e8m0fnu block scales")
            return TensorInfo(dtype, True, nbytes + s_bytes)
        if dtype not in FLOATS:
            raise CheckpointError(f"tensor {name} in {where} has dtype {dtype}; expected float32, bfloat16, "
                                  "float16 or float8_e4m3fn (with weight_scale_inv)")
        return TensorInfo(dtype, False, nbytes)

    def check_all(self, cfg: ModelConfig) -> dict[str, TensorInfo]:
        """{HF name: info} of every tensor of `cfg`; raises on the first mismatch, then on any
        tensor the config does not use. MTP copies of the embedding and head are checked too."""
        infos = {}
        for leaf in hf_names.leaves(cfg):
            shape = leaf.hf_shapes()[0]  # experts: E equal shapes
            for _, names in hf_names.leaf_slices(leaf):
                infos.update({n: self.check(n, shape) for n in names})
        used = set(infos) | {scale_name(n) for n, info in infos.items() if info.fp8}
        for copy, main in self.mtp_copies(cfg):
            self.check(copy, self.ckpt.header(main)[0])
            used.add(copy)
        extra = sorted(set(self.ckpt.names()) - used)
        if extra:
            shown = ", ".join(f"{n} ({self.ckpt.where(n)})" for n in extra[:5])
            raise CheckpointError(f"{len(extra)} unexpected tensor(s) that {self.config_path} does not use: "
                                  f"{shown}{' ...' if len(extra) > 5 else ''}")
        return infos

    def mtp_copies(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        """(copy, main) pairs present: each MTP layer may store the embedding and head again."""
        return [(c, m) for c, m in hf_names.mtp_shared_copies(cfg) if c in self.ckpt]

    def compare_mtp_copies(self, cfg: ModelConfig, progress: Callable[[int], None] = lambda n: None,
                           part: tuple[int, int] = (0, 1)) -> bool:
        """Warns where an MTP copy differs from the main tensor (the model uses the main one),
        comparing row blocks. `part` = (i, n): only the i-th of n equal row ranges is compared (each
        of n processes compares its own, so none reads a whole embedding or head). Returns whether
        the folder has copies."""
        pairs = self.mtp_copies(cfg)
        for copy, main in pairs:
            shape = self.ckpt.header(main)[0]
            share = -(-shape[0] // part[1])
            first, last = min(shape[0], part[0] * share), min(shape[0], (part[0] + 1) * share)
            step = max(1, COMPARE_BLOCK_BYTES // max(math.prod(shape[1:]) * 4, 1))
            same = True
            for r0 in range(first, last, step):
                a = self.window(copy, slice(r0, min(last, r0 + step)))
                b = self.window(main, slice(r0, min(last, r0 + step)))
                same = same and np.array_equal(a, b)
                progress(a.nbytes + b.nbytes)
            if not same:
                logging.warning("%s (%s) differs from %s; the MTP module uses the main model's copy",
                                copy, self.ckpt.where(copy), main)
        return bool(pairs)

    def window(self, name: str, rows: slice | None = None, cols: slice | None = None,
               dtype=np.float32) -> np.ndarray:
        """tensor[rows, cols] (1-D tensors: [rows]) as a new `dtype` array; only those rows are
        mapped, and for FP8 only the scale blocks covering the window are read."""
        shape, stored, _ = self.ckpt.header(name)
        rows = _bounded(rows, shape[0])
        cols = _bounded(cols, shape[1]) if len(shape) == 2 else None
        if stored != fp8.E4M3:
            return self._read(name, rows, cols).astype(dtype)
        return fp8.dequantize_window(lambda r, c: self._read(name, r, c), lambda r, c: self.scales(name, r, c),
                                     rows, cols, dtype)

    def scales(self, name: str, rows: slice, cols: slice | None = None) -> np.ndarray:
        """Block rows x columns of the scales of FP8 tensor `name` as fp32 (stored fp32 or e8m0);
        with `scale_fmt: "ue8m0"` in config.json each must be a power of two."""
        s = np.array(self._read(scale_name(name), rows, cols), np.float32)  # stored fp32 or e8m0
        bad = fp8.not_pow2(s) if self.scale_fmt == "ue8m0" else None
        if bad is not None:
            where = (rows.start + bad[0], bad[1] + ((cols.start or 0) if cols is not None else 0))
            raise CheckpointError(f"tensor {scale_name(name)} in {self.ckpt.where(scale_name(name))}: block scale "
                                  f"{s[bad]} at block {where} is not a power of two, but {self.config_path} says "
                                  "scale_fmt 'ue8m0'")
        return s

    def _read(self, name: str, rows: slice, cols: slice | None) -> np.ndarray:
        """A memory-mapped view of tensor[rows, cols] (nothing copied yet), counted in `bytes_read`."""
        x = self.ckpt.read_rows(name, rows.start, rows.stop)
        x = x[:, cols] if cols is not None else x
        self.bytes_read += x.nbytes
        return x

    def raw_fp8(self, leaf: hf_names.Leaf) -> Callable:
        """For a leaf stored in e4m3: (stack, "q" | "scale", rows, cols) -> that window of its HF
        tensor as stored, or of its block scales as fp32 (`scales`): the `RawFp8` of `quantized`."""
        def raw(stack: tuple[int, ...], part: str, rows: slice, cols: slice) -> np.ndarray:
            if part == "scale":
                return self.scales(leaf.hf_name(stack), rows, cols)
            return np.array(self._read(leaf.hf_name(stack), rows, cols))

        return raw

    def leaf_window(self, leaf: hf_names.Leaf, dtype) -> Callable:
        """`window` for `read_shard`: (stack index, rows, cols) -> that HF tensor's window."""
        def window(stack: tuple[int, ...], rows: slice, cols: slice | None = None) -> np.ndarray:
            return self.window(leaf.hf_name(stack), rows, cols, dtype)

        return window


def _bounded(s: slice | None, n: int) -> slice:
    start, stop, _ = (s or slice(None)).indices(n)
    return slice(start, stop)


def index_bounds(index: tuple, shape: tuple[int, ...]) -> list[slice]:
    """`index` (a device's shard index, trailing dims left out) as one slice per dim, start and stop set."""
    return [_bounded(s, n) for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)]


def read_shard(leaf: hf_names.Leaf, shape: tuple[int, ...], index: tuple, window: Callable,
               dtype) -> np.ndarray:
    """`ours[index]` for parameter `leaf` of `shape`, built from HF-oriented windows:
    `window(stack, rows, cols)` gives HF tensor `stack` ((), (layer,) or (layer, expert) in our
    stacked dims) restricted to rows x cols, as `dtype`. Nothing outside the shard is read except,
    when a split dimension's inner part is itself cut, the rest of its outer rows."""
    bounds = index_bounds(index, shape)
    k = hf_names.stacked_dims(leaf)
    out = np.empty([b.stop - b.start for b in bounds], dtype)
    for stack in itertools.product(*(range(b.start, b.stop) for b in bounds[:k])):
        local = tuple(i - b.start for i, b in zip(stack, bounds))
        out[local] = _slice(leaf.layout, shape[k:], bounds[k:], lambda r, c=None: window(stack, r, c))
    return out


def _slice(layout: hf_names.Layout, shape: tuple[int, ...], bounds: list[slice], window: Callable) -> np.ndarray:
    """One HF tensor's part of a shard: the HF window covering `bounds`, transposed and split."""
    groups, d = [], 0
    for n in layout.split:
        groups.append(list(range(d, d + n)))
        d += n
    hf_dims, split_shape, pick = [], [], []
    for g in groups:
        inner = math.prod(shape[i] for i in g[1:])
        outer = bounds[g[0]]
        hf_dims.append(slice(outer.start * inner, outer.stop * inner))
        split_shape += [outer.stop - outer.start] + [shape[i] for i in g[1:]]
        pick += [slice(None)] + [bounds[i] for i in g[1:]]
    x = window(*(hf_dims[::-1] if layout.transposed else hf_dims))
    x = x.T if layout.transposed else x
    return x.reshape(split_shape)[tuple(pick)]

"""Our Orbax checkpoint layout, written array by array (slice by slice) with tensorstore.

    CKPT/
      _CHECKPOINT_METADATA   Orbax composite metadata: items `params`, `config` (and `fp8`)
      config/metadata        JSON: {"format", "version", "model": ModelConfig.to_dict(), "source": {...}}
      params/                StandardCheckpointHandler item: the pure dict of the model's `nnx.Param`
                             and `RouterBias` state, stacked layers included ([L, ...])
      fp8/                   only with --keep-fp8: {param path: {"qvalue": e4m3 [.., out, in],
                             "scale_inv": f32 [.., ceil(out/128), ceil(in/128)]}}, HF orientation
                             (the [N, K] / [NB, KB] layout of `pallas_kernels.fp8_matmul`)
      integrity/metadata     JSON: {"checksums": {item: {array name: checksum}}} (`integrity`),
                             summed over the pieces as they are written

`params` and `fp8` are what Orbax's StandardCheckpointHandler writes with `use_ocdbt=False` (a zarr
folder per array), so
`ocp.StandardCheckpointer().restore(CKPT / "params", abstract)` and an Orbax `Composite` restore
read them, with any target sharding. We write them ourselves because Orbax saves whole arrays and
one stacked expert tensor of the real model is 436 GB: tensorstore lets us write each zarr array one
[layer, expert] slice (one chunk file) at a time. Everything read back goes through Orbax's public
API: the items' JSON and array metadata through its handlers, an array's TensorStore spec (in a
zarr folder or an OCDBT database, e.g. a training step's `state`) through `ocp.type_handlers`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from dsv3_jax import paths
from dsv3_jax.checkpoint import integrity
from dsv3_jax.checkpoint.safetensors_io import CheckpointError

PARAMS, FP8, CONFIG = "params", "fp8", "config"
FORMAT, VERSION = "dsv3_jax", 1
# An item's handler as Orbax records it in _CHECKPOINT_METADATA: the class's module and name.
_ARRAYS, _JSON = ocp.StandardCheckpointHandler, ocp.JsonCheckpointHandler
_HANDLERS = {PARAMS: _ARRAYS, FP8: _ARRAYS, CONFIG: _JSON, integrity.ITEM: _JSON}
_TS_DTYPES = {np.dtype(ml_dtypes.bfloat16): ts.bfloat16, np.dtype(ml_dtypes.float8_e4m3fn): ts.float8_e4m3fn}


def _context() -> ts.Context:
    # No tensorstore cache: written chunks must not accumulate in memory.
    # No fsync per chunk file: the converter syncs once before it renames the folder into place.
    # The OCDBT b-tree cache is Orbax's (the spec it gives for an array in a database names it).
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}, "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
                       "file_io_concurrency": {"limit": 16}, "file_io_sync": False})


class ItemWriter:
    """Writes one Orbax StandardCheckpointHandler item (a nested dict of arrays) with tensorstore.

    `create` returns a tensorstore array to write slices into; `write` keeps a bounded number of
    bytes in flight so reading, converting and writing overlap without memory growing, and adds
    each slice's checksum to its array's in `checksums` (a sum: slices in any order add up).
    """

    MAX_IN_FLIGHT = 256 << 20  # bytes written asynchronously at most

    def __init__(self, item_dir: str):
        self.dir = item_dir
        paths.makedirs(item_dir)
        self._ctx = _context()
        self._keys: list[tuple[str, ...]] = []
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.checksums: dict[str, int] = {}
        self._pending: list[tuple[Any, int]] = []

    def create(self, path: tuple[str, ...], shape: tuple[int, ...], dtype, *, chunks: list[int]) -> ts.TensorStore:
        """A new zarr array cut into `chunks`: the blocks the caller writes, so no write touches
        another's chunk file."""
        dtype = np.dtype(dtype)
        self._keys.append(tuple(path))
        self._shapes[".".join(path)], self.checksums[".".join(path)] = tuple(shape), 0
        # Orbax's non-OCDBT layout: one zarr folder per array, one file per chunk. (Writing into one
        # OCDBT database commits its manifest on every slice write: 50x slower here.)
        spec = {"driver": "zarr", "kvstore": paths.kvstore(paths.join(self.dir, ".".join(path))),
                "metadata": {"compressor": None, "chunks": [max(1, c) for c in chunks]}}
        return ts.open(spec, create=True, dtype=_TS_DTYPES.get(dtype, ts.dtype(dtype.name)),
                       shape=list(shape), context=self._ctx).result()

    def write(self, target, value: np.ndarray) -> None:
        """`target[...] = value` asynchronously, waiting first if too many bytes are in flight."""
        # As stored (what tensorstore would convert and broadcast it to): what its checksum is of.
        value = np.ascontiguousarray(np.broadcast_to(value, target.domain.shape), target.dtype.numpy_dtype)
        name = target.kvstore.path.rstrip("/").rsplit("/", 1)[-1]  # `create`'s zarr folder of the array
        piece = integrity.checksum_block(value, self._shapes[name], target.domain.inclusive_min)
        self.checksums[name] = (self.checksums[name] + piece) % 2**32
        fut = target.write(value)
        self._pending.append((fut, value.nbytes))
        while sum(n for _, n in self._pending) > self.MAX_IN_FLIGHT:
            self._pending.pop(0)[0].result()

    def finish(self) -> None:
        while self._pending:
            self._pending.pop(0)[0].result()
        tree = {str(k): {"key_metadata": [{"key": p, "key_type": 2} for p in k],
                         "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False}}
                for k in self._keys}
        paths.write_text(paths.join(self.dir, "_METADATA"), json.dumps(
            {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
             "store_array_data_equal_to_fill_value": True, "custom_metadata": None}))


def write_config(root: str, meta: dict[str, Any], items: list[str],
                 checksums: dict[str, dict[str, int]] | None = None) -> None:
    """Written last: a folder without these files is not a checkpoint (see `is_orbax_checkpoint`).
    `checksums`: {item: `ItemWriter.checksums`}, the `integrity` item. The JSON items are what
    Orbax's JsonCheckpointHandler writes (and reads back: `read_meta`, `integrity.read_manifest`)."""
    paths.makedirs(paths.join(root, CONFIG))
    paths.write_text(paths.join(root, CONFIG, "metadata"), json.dumps({"format": FORMAT, "version": VERSION, **meta}))
    if checksums is not None:
        items = [*items, integrity.ITEM]
        paths.makedirs(paths.join(root, integrity.ITEM))
        paths.write_text(paths.join(root, integrity.ITEM, "metadata"), json.dumps({"checksums": checksums}))
    now = time.time_ns()
    paths.write_text(paths.join(root, "_CHECKPOINT_METADATA"), json.dumps(
        {"item_handlers": {k: f"{_HANDLERS[k].__module__}.{_HANDLERS[k].__qualname__}" for k in [*items, CONFIG]},
         "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now,
         "custom_metadata": {}}))


def is_orbax_checkpoint(path: str) -> bool:
    return all(paths.at(paths.join(path, *p)).exists() for p in
               [("_CHECKPOINT_METADATA",), (CONFIG, "metadata"), (PARAMS, "_METADATA")])


def read_meta(root: str) -> dict[str, Any]:
    path = paths.join(root, CONFIG, "metadata")
    try:
        meta = ocp.JsonCheckpointHandler().restore(paths.at(paths.join(root, CONFIG)))
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(f"{root} is not a dsv3_jax Orbax checkpoint: cannot read {path} ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


@functools.cache
def _arrays_handler() -> ocp.StandardCheckpointHandler:
    """The handler that reads items' array metadata; made quietly (Orbax logs its settings at INFO
    on creation: noise in the output of a CLI that logs at INFO)."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.WARNING)
    try:
        return ocp.StandardCheckpointHandler()
    finally:
        absl_logger.setLevel(level)


class ItemReader:
    """Reads slices of the arrays of one item that Orbax's Standard/PyTree handlers wrote (or
    `ItemWriter`), without restoring whole arrays: `arrays` and each array's TensorStore spec come
    from Orbax's public API, so any layout Orbax writes (a zarr folder per array, an OCDBT
    database) reads, e.g. the `state` item of a training step."""

    def __init__(self, root: str, item: str):
        self.dir = paths.join(root, item)
        self._ctx = _context()
        self._open: dict[tuple[str, ...], ts.TensorStore] = {}
        self._ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(paths.at(self.dir))
        try:
            tree = _arrays_handler().metadata(paths.at(self.dir)).tree
        except (OSError, ValueError, KeyError):
            tree = {}
        # {key path: Orbax's ArrayMetadata (shape, dtype)} of every array in the item
        self.arrays = {tuple(str(k) for k in key): m for key, m in ocp.tree.to_flat_dict(tree).items()}

    def _ts_open(self, name: str) -> ts.TensorStore:
        info = ocp.type_handlers.ParamInfo(name=name, parent_dir=paths.at(self.dir),
                                           is_ocdbt_checkpoint=self._ocdbt, ts_context=self._ctx)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._ocdbt)
        return ts.open(spec, open=True, context=self._ctx).result()

    def array(self, path: tuple[str, ...]) -> ts.TensorStore:
        if path not in self._open:
            try:
                self._open[path] = self._ts_open(".".join(path))
            except ValueError as e:
                raise CheckpointError(f"{self.dir}: cannot open array {'.'.join(path)} ({e})") from None
        return self._open[path]

    def read(self, path: tuple[str, ...], index=()) -> np.ndarray:
        return np.asarray(self.array(path)[index].read().result())

    def check(self, step: int | None, manifest: dict[str, int], names=None) -> None:
        """Reads the arrays `names` (default: all the manifest lists) block by block and checks
        each against the manifest's checksum; this process's share when there are several."""
        names = sorted(manifest if names is None else set(names) & set(manifest))
        for name in names[jax.process_index()::jax.process_count()]:
            try:
                arr = self._ts_open(name)
                shape = tuple(arr.shape)
                total = sum(integrity.checksum_block(arr[index].read().result(), shape, index)
                            for index in _blocks(shape, arr.dtype.numpy_dtype.itemsize)) % 2**32
            except Exception as e:  # TensorStore's read errors on a damaged or truncated file
                raise integrity.damaged(step, self.dir, name, integrity.first_line(e)) from None
            if total != manifest[name]:
                raise integrity.damaged(step, self.dir, name,
                                        f"checksum {total:#010x}, recorded {manifest[name]:#010x}")


def _blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int = 256 << 20):
    """Leading indices of C-contiguous blocks of at most `block_bytes`."""
    lead = 0
    while lead < len(shape) and math.prod(shape[lead:]) * itemsize > block_bytes:
        lead += 1
    yield from np.ndindex(*shape[:lead])

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
[layer, expert] slice (one chunk file) at a time.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

from dsv3_jax import paths
from dsv3_jax.checkpoint import integrity
from dsv3_jax.checkpoint.safetensors_io import CheckpointError

PARAMS, FP8, CONFIG = "params", "fp8", "config"
FORMAT, VERSION = "dsv3_jax", 1
CHUNK_BYTES = 64 << 20
_HANDLERS = {
    PARAMS: "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler",
    FP8: "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler",
    CONFIG: "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler",
}
_HANDLERS[integrity.ITEM] = _HANDLERS[CONFIG]
_TS_DTYPES = {np.dtype(ml_dtypes.bfloat16): ts.bfloat16, np.dtype(ml_dtypes.float8_e4m3fn): ts.float8_e4m3fn}


def _context() -> ts.Context:
    # No tensorstore cache: written chunks must not accumulate in memory.
    # No fsync per chunk file: the converter syncs once before it renames the folder into place.
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_concurrency": {"limit": 16},
                       "file_io_sync": False})


def _kvstore(item_dir: str, name: str) -> dict:
    # Orbax's non-OCDBT layout: one zarr folder per array, one file per chunk. (Writing into one
    # OCDBT database commits its manifest on every slice write: 50x slower here.) A local folder
    # or a URL (dsv3_jax/paths.py): `file` or the URL's driver, e.g. `gcs`.
    return paths.kvstore(paths.join(item_dir, name))


def chunk_shape(shape: tuple[int, ...], itemsize: int, stacked: int = 0, target: int = CHUNK_BYTES) -> list[int]:
    """The `stacked` leading dims (layer, expert: the units written) cut to 1, then further leading
    dims cut until a chunk is at most `target` bytes. A write then never rewrites another's chunk."""
    chunk = [1 if i < stacked else max(1, n) for i, n in enumerate(shape)]
    for i in range(stacked, len(chunk)):
        if math.prod(chunk) * itemsize <= target:
            break
        rest = math.prod(chunk[i + 1:]) * itemsize
        chunk[i] = max(1, min(chunk[i], target // max(rest, 1)))
    return chunk


class ItemWriter:
    """Writes one Orbax StandardCheckpointHandler item (a nested dict of arrays) with tensorstore.

    `create` returns a tensorstore array to write slices into; `write` keeps a bounded number of
    bytes in flight so reading, converting and writing overlap without memory growing, and adds
    each slice's checksum to its array's in `checksums` (a sum: slices in any order add up).
    """

    def __init__(self, item_dir: str, max_in_flight: int = 256 << 20):
        self.dir = item_dir
        paths.makedirs(item_dir)
        self._ctx = _context()
        self._keys: list[tuple[str, ...]] = []
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.checksums: dict[str, int] = {}
        self._pending: list[tuple[Any, int]] = []
        self._max_in_flight = max_in_flight

    def create(self, path: tuple[str, ...], shape: tuple[int, ...], dtype, *, stacked: int = 0,
               chunks: list[int] | None = None) -> ts.TensorStore:
        """A new zarr array; `stacked` leading dims are written one index at a time (see `chunk_shape`)."""
        dtype = np.dtype(dtype)
        self._keys.append(tuple(path))
        self._shapes[".".join(path)], self.checksums[".".join(path)] = tuple(shape), 0
        chunks = chunks or chunk_shape(shape, dtype.itemsize, stacked)
        spec = {"driver": "zarr", "kvstore": _kvstore(self.dir, ".".join(path)),
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
        while sum(n for _, n in self._pending) > self._max_in_flight:
            self._pending.pop(0)[0].result()

    def flush(self) -> None:
        while self._pending:
            self._pending.pop(0)[0].result()

    def finish(self) -> None:
        self.flush()
        tree = {str(k): {"key_metadata": [{"key": p, "key_type": 2} for p in k],
                         "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False}}
                for k in self._keys}
        _write_json(paths.join(self.dir, "_METADATA"),
                    {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
                     "store_array_data_equal_to_fill_value": True, "custom_metadata": None})


def _write_json(path: str, obj) -> None:
    paths.write_text(path, json.dumps(obj))


def _read_json(path: str):
    return json.loads(paths.at(path).read_text())


def write_config(root: str, meta: dict[str, Any], items: list[str],
                 checksums: dict[str, dict[str, int]] | None = None) -> None:
    """Written last: a folder without these files is not a checkpoint (see `is_orbax_checkpoint`).
    `checksums`: {item: `ItemWriter.checksums`}, the `integrity` item."""
    paths.makedirs(paths.join(root, CONFIG))
    _write_json(paths.join(root, CONFIG, "metadata"), {"format": FORMAT, "version": VERSION, **meta})
    if checksums is not None:
        items = [*items, integrity.ITEM]
        paths.makedirs(paths.join(root, integrity.ITEM))
        _write_json(paths.join(root, integrity.ITEM, "metadata"), {"checksums": checksums})
    now = time.time_ns()
    _write_json(paths.join(root, "_CHECKPOINT_METADATA"),
                {"item_handlers": {k: _HANDLERS[k] for k in [*items, CONFIG]}, "metrics": {},
                 "performance_metrics": {}, "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now,
                 "custom_metadata": {}})


def is_orbax_checkpoint(path: str) -> bool:
    return all(paths.at(paths.join(path, *p)).exists() for p in
               [("_CHECKPOINT_METADATA",), (CONFIG, "metadata"), (PARAMS, "_METADATA")])


def read_meta(root: str) -> dict[str, Any]:
    path = paths.join(root, CONFIG, "metadata")
    try:
        meta = _read_json(path)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{root} is not a dsv3_jax Orbax checkpoint: cannot read {path} ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def item_keys(root: str, item: str) -> set[tuple[str, ...]]:
    path = paths.join(root, item, "_METADATA")
    if not paths.at(path).exists():
        return set()
    tree = _read_json(path)["tree_metadata"]
    return {tuple(k["key"] for k in v["key_metadata"]) for v in tree.values()}


class ItemReader:
    """Reads slices of the arrays of one item without restoring whole arrays: ours (a zarr folder
    per array) or any item Orbax's Standard/PyTree handlers wrote, in the layout its `_METADATA`
    names (an OCDBT database, zarr or zarr3), e.g. the `state` item of a training step."""

    def __init__(self, root: str, item: str):
        self.dir = paths.join(root, item)
        self._ctx = _context()
        self._open: dict[tuple[str, ...], ts.TensorStore] = {}
        try:
            layout = _read_json(paths.join(self.dir, "_METADATA"))
        except (OSError, json.JSONDecodeError):
            layout = {}
        self._ocdbt = bool(layout.get("use_ocdbt", False))
        self._driver = "zarr3" if layout.get("use_zarr3") else "zarr"

    def _spec(self, name: str) -> dict:
        if self._ocdbt:  # one database for the item; an array is a key prefix in it
            base = paths.kvstore(self.dir)
            return {"driver": self._driver, "kvstore": {"driver": "ocdbt", "base": base, "path": name + "/"}}
        return {"driver": self._driver, "kvstore": _kvstore(self.dir, name)}

    def array(self, path: tuple[str, ...]) -> ts.TensorStore:
        if path not in self._open:
            spec = self._spec(".".join(path))
            try:
                self._open[path] = ts.open(spec, open=True, context=self._ctx).result()
            except ValueError as e:
                raise CheckpointError(f"{self.dir}: cannot open array {'.'.join(path)} ({e})") from None
        return self._open[path]

    def read(self, path: tuple[str, ...], index=()) -> np.ndarray:
        arr = self.array(path)
        return np.asarray(arr[index].read().result() if index != () else arr.read().result())

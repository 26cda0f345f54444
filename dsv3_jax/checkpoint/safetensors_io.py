"""Memory-mapped safetensors reading and streaming writing, any dtype (bf16, fp8 via ml_dtypes).

The format: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw bytes. Reading maps the file and returns views, so only the tensors
touched are paged in; nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or does not fit the config."""


class SafetensorsFile:
    """Read-only view of one .safetensors file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise CheckpointError(f"safetensors file {self.path} does not exist") from None
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path} is not a safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries = header
        self._base = 8 + n
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self.entries[name]["dtype"]
        if code not in DTYPES:
            raise CheckpointError(f"tensor {name} in {self.path} has unsupported dtype {code}")
        return DTYPES[code]

    def nbytes(self, name: str) -> int:
        start, end = self.entries[name]["data_offsets"]
        return end - start

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` through a memory map of its own byte range only.

        The map is released when the returned array (and every view of it) is dropped, so a
        streaming reader's resident memory stays at the tensors in use, however large the file.
        """
        if name not in self.entries:
            raise CheckpointError(f"tensor {name} is not in {self.path}")
        start, end = self.entries[name]["data_offsets"]
        dtype, shape = self.dtype(name), self.shape(name)
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != dtype.itemsize * count or self._base + end > os.path.getsize(self.path):
            raise CheckpointError(f"tensor {name} in {self.path} is truncated or its offsets are corrupt")
        if count == 0:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._base + start, shape=tuple(shape))

    def read_rows(self, name: str, start_row: int, end_row: int) -> np.ndarray:
        """Rows [start_row, end_row) of tensor `name`, mapping only their bytes."""
        full = self.shape(name)
        dtype = self.dtype(name)
        row_bytes = dtype.itemsize * int(np.prod(full[1:], dtype=np.int64))
        self.read(name)  # validates the offsets; maps nothing that stays resident
        begin = self._base + self.entries[name]["data_offsets"][0] + start_row * row_bytes
        return np.memmap(self.path, dtype=dtype, mode="r", offset=begin,
                         shape=(end_row - start_row, *full[1:]))

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of tensor `name`."""
        if name not in self.entries:
            raise CheckpointError(f"tensor {name} is not in {self.path}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = self.entries[name]["data_offsets"]
        raw = self._mmap[self._base + start:self._base + end]
        dtype, shape = self.dtype(name), self.shape(name)
        if raw.size != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"tensor {name} in {self.path} is truncated or its offsets are corrupt")
        return raw.view(dtype).reshape(shape)


class ShardWriter:
    """Writes one safetensors file whose header (names, dtypes, shapes) is known up front and
    whose tensors arrive one at a time, in header order: memory stays at one tensor."""

    def __init__(self, path: str | os.PathLike, specs: list[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name, dtype, shape in specs:
            dtype = np.dtype(dtype)
            if dtype not in NAMES:
                raise CheckpointError(f"cannot write tensor {name} of dtype {dtype} to safetensors")
            nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path, self.nbytes = os.fspath(path), 8 + len(blob) + offset
        self._pending = [(name, np.dtype(dtype), tuple(shape)) for name, dtype, shape in specs]
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(blob)))
        self._f.write(blob)

    def write(self, name: str, arr: np.ndarray) -> None:
        want = self._pending.pop(0)
        if (name, arr.dtype, tuple(arr.shape)) != want:
            raise CheckpointError(f"{self.path}: got {name} {arr.dtype} {tuple(arr.shape)}, the header says {want}")
        self._f.write(np.ascontiguousarray(arr).tobytes())

    def write_blocks(self, name: str, dtype, shape: tuple[int, ...], blocks: Iterable[np.ndarray]) -> None:
        """Writes tensor `name` from consecutive row blocks (memory: one block)."""
        want = self._pending.pop(0)
        if (name, np.dtype(dtype), tuple(shape)) != want:
            raise CheckpointError(f"{self.path}: got {name} {dtype} {tuple(shape)}, the header says {want}")
        rows = 0
        for block in blocks:
            if block.dtype != want[1] or tuple(block.shape[1:]) != tuple(shape[1:]):
                raise CheckpointError(f"{self.path}: block of {name} is {block.dtype} {block.shape}")
            self._f.write(np.ascontiguousarray(block).tobytes())
            rows += block.shape[0]
        if rows != shape[0]:
            raise CheckpointError(f"{self.path}: {name} got {rows} rows, the header says {shape[0]}")

    def close(self, check: bool = True) -> None:
        self._f.close()
        if check and self._pending:
            raise CheckpointError(f"{self.path}: {len(self._pending)} tensor(s) never written, "
                                  f"first {self._pending[0][0]}")


def write_safetensors(path: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]] | Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Writes tensors one at a time (the header is computed from shapes first). Returns bytes written."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, arr in items:
        nbytes = arr.dtype.itemsize * int(np.prod(arr.shape, dtype=np.int64))
        if arr.dtype not in NAMES:
            raise CheckpointError(f"cannot write tensor {name} of dtype {arr.dtype} to safetensors")
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in items:
            f.write(np.ascontiguousarray(arr).tobytes())
    return 8 + len(blob) + offset


class HFCheckpoint:
    """An HF folder: one `model.safetensors` or `model.safetensors.index.json` plus shards."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        index_path = os.path.join(self.folder, "model.safetensors.index.json")
        single = os.path.join(self.folder, "model.safetensors")
        self._files: dict[str, SafetensorsFile] = {}
        if os.path.exists(index_path):
            with open(index_path) as f:
                try:
                    self.weight_map: dict[str, str] = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise CheckpointError(f"{index_path} has no valid weight_map ({e})") from None
            for shard in sorted(set(self.weight_map.values())):
                if not os.path.exists(os.path.join(self.folder, shard)):
                    raise CheckpointError(f"{index_path} names shard {shard}, which is not in {self.folder}")
        elif os.path.exists(single):
            self.weight_map = {k: "model.safetensors" for k in self._file("model.safetensors").keys()}
        else:
            raise CheckpointError(f"{self.folder} has neither model.safetensors nor model.safetensors.index.json")

    def _file(self, shard: str) -> SafetensorsFile:
        if shard not in self._files:
            self._files[shard] = SafetensorsFile(os.path.join(self.folder, shard))
        return self._files[shard]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def where(self, name: str) -> str:
        return os.path.join(self.folder, self.weight_map.get(name, "?"))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(self.weight_map[name]).shape(name)

    def header(self, name: str) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape, dtype, nbytes) from the shard header, without touching the data."""
        shard = self._shard_of(name)
        return shard.shape(name), shard.dtype(name), shard.nbytes(name)

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` mapped on its own (see `SafetensorsFile.read`)."""
        return self._shard_of(name).read(name)

    def read_rows(self, name: str, start_row: int, end_row: int) -> np.ndarray:
        return self._shard_of(name).read_rows(name, start_row, end_row)

    def _shard_of(self, name: str) -> SafetensorsFile:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name} is missing from {self.folder}")
        shard = self._file(self.weight_map[name])
        if name not in shard:
            raise CheckpointError(f"{self.folder}: the index puts {name} in {shard.path}, which lacks it")
        return shard

    def get(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name} is missing from {self.folder}")
        shard = self._file(self.weight_map[name])
        if name not in shard:
            raise CheckpointError(f"{self.folder}: the index puts {name} in {shard.path}, which lacks it")
        return shard.get(name)

    def iter_shards(self) -> Iterator[tuple[str, list[str]]]:
        by_shard: dict[str, list[str]] = {}
        for name, shard in self.weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        yield from sorted(by_shard.items())

"""Memory-mapped safetensors reading and streaming writing, any dtype (bf16, fp8 via ml_dtypes).

The format: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw bytes. Reading maps the file and returns views, so only the tensors
touched are paged in; nothing is unpickled.
"""

from __future__ import annotations

import json
import math
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
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16),
    "C64": np.dtype(np.complex64), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz), "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or does not fit the config."""


class SafetensorsFile:
    """Read-only view of one .safetensors file whose header is checked at open (`_read_header`,
    `_check_layout`), so that a damaged file is refused by name before a byte of it is used."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                header, self._base = _read_header(self.path, f, size)
        except FileNotFoundError:
            raise CheckpointError(f"safetensors file {self.path} does not exist") from None
        self.metadata = _check_metadata(self.path, header.pop("__metadata__", None))
        self.entries = header
        _check_layout(self.path, header, size - self._base)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self.entries[name]["dtype"]]

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` through a memory map of its own byte range only.

        The map is released when the returned array (and every view of it) is dropped, so a
        streaming reader's resident memory stays at the tensors in use, however large the file.
        """
        if name not in self.entries:
            raise CheckpointError(f"tensor {name} is not in {self.path}")
        shape = self.shape(name)
        if math.prod(shape) == 0:  # a map of no bytes is an error
            return np.zeros(shape, self.dtype(name))
        return np.memmap(self.path, dtype=self.dtype(name), mode="r",
                         offset=self._base + self.entries[name]["data_offsets"][0], shape=shape)

    def read_rows(self, name: str, start_row: int, end_row: int) -> np.ndarray:
        """Rows [start_row, end_row) of tensor `name`, mapping only their bytes."""
        full, dtype = self.shape(name), self.dtype(name)
        row_bytes = dtype.itemsize * math.prod(full[1:])
        begin = self._base + self.entries[name]["data_offsets"][0] + start_row * row_bytes
        return np.memmap(self.path, dtype=dtype, mode="r", offset=begin, shape=(end_row - start_row, *full[1:]))


def _read_header(path: str, f, size: int) -> tuple[dict, int]:
    """(the JSON header, where the data starts). The length field is checked against the file
    before that many bytes are read: a damaged one must not become a huge allocation."""
    if size < 8:
        raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, fewer than its 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(f"{path} is damaged: its header length field says {n} bytes, the file holds "
                              f"{size - 8} after it (the format allows {MAX_HEADER_BYTES})")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is damaged: its header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is damaged: its header is a JSON {type(header).__name__}, not an object")
    return header, 8 + n


def _check_metadata(path: str, meta) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings, not {meta!r:.200}")
    return meta


def _naturals(x) -> bool:
    return isinstance(x, list) and all(type(v) is int and v >= 0 for v in x)


def _check_layout(path: str, entries: dict, data_bytes: int) -> None:
    """Every tensor of a known dtype with shape x itemsize bytes, and the tensors, in offset order,
    tiling the data section exactly: no overlap (a tensor reading its neighbour's bytes), no gap,
    nothing cut off by a truncation or left over after the last tensor."""
    spans = []
    for name, e in entries.items():
        if not (isinstance(e, dict) and _naturals(e.get("shape")) and _naturals(e.get("data_offsets"))
                and len(e["data_offsets"]) == 2):
            raise CheckpointError(f"tensor {name} in {path} has a malformed header entry {e!r:.200}")
        if e.get("dtype") not in DTYPES:
            raise CheckpointError(f"tensor {name} in {path} has unsupported dtype {e.get('dtype')!r}")
        begin, end = e["data_offsets"]
        need = DTYPES[e["dtype"]].itemsize * math.prod(e["shape"])
        if end - begin != need:
            raise CheckpointError(f"tensor {name} in {path} is {e['dtype']} {e['shape']}, {need} bytes, but its "
                                  f"data_offsets [{begin}, {end}] span {end - begin}")
        spans.append((begin, end, name))
    pos, prev = 0, "the data section's start"
    for begin, end, name in sorted(spans):
        if begin != pos:
            how = "overlaps" if begin < pos else f"leaves {begin - pos} unused bytes after"
            raise CheckpointError(f"tensor {name} in {path} starts at data byte {begin}: it {how} {prev}, "
                                  f"which ends at {pos}")
        if end > data_bytes:
            raise CheckpointError(f"tensor {name} in {path} ends at data byte {end}, but the file holds {data_bytes}: "
                                  f"it is truncated")
        pos, prev = end, f"tensor {name}"
    if pos != data_bytes:
        raise CheckpointError(f"{path} holds {data_bytes - pos} bytes after {prev} that no tensor covers")


class ShardWriter:
    """Writes one safetensors file whose header (names, dtypes, shapes) is known up front and
    whose tensors arrive one at a time, in header order: memory stays at one tensor."""

    def __init__(self, path: str | os.PathLike, specs: list[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._pending, offset = [(name, np.dtype(dtype), tuple(shape)) for name, dtype, shape in specs], 0
        for name, dtype, shape in self._pending:
            if dtype not in NAMES:
                raise CheckpointError(f"cannot write tensor {name} of dtype {dtype} to safetensors")
            nbytes = dtype.itemsize * math.prod(shape)
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path, self.nbytes = os.fspath(path), 8 + len(blob) + offset
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(blob)))
        self._f.write(blob)

    def _next(self, name: str, dtype, shape: tuple[int, ...]) -> tuple[str, np.dtype, tuple[int, ...]]:
        want = self._pending.pop(0)
        if (name, np.dtype(dtype), tuple(shape)) != want:
            raise CheckpointError(f"{self.path}: got {name} {dtype} {tuple(shape)}, the header says {want}")
        return want

    def write(self, name: str, arr: np.ndarray) -> None:
        self._next(name, arr.dtype, arr.shape)
        self._f.write(np.ascontiguousarray(arr).tobytes())

    def close(self, check: bool = True) -> None:
        self._f.close()
        if check and self._pending:
            raise CheckpointError(f"{self.path}: {len(self._pending)} tensor(s) never written, "
                                  f"first {self._pending[0][0]}")


def write_safetensors(path: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]] | Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Writes tensors one at a time (the header is computed from shapes first). Returns bytes written."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    writer = ShardWriter(path, [(name, arr.dtype, arr.shape) for name, arr in items], metadata)
    for name, arr in items:
        writer.write(name, arr)
    writer.close()
    return writer.nbytes


class HFCheckpoint:
    """An HF folder: one `model.safetensors` or `model.safetensors.index.json` plus shards."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        index_path = os.path.join(self.folder, "model.safetensors.index.json")
        single = os.path.join(self.folder, "model.safetensors")
        self._files: dict[str, SafetensorsFile] = {}
        self.listing = index_path if os.path.exists(index_path) else single  # the file that lists the tensors
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

    def header(self, name: str) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape, dtype, nbytes) from the shard header, without touching the data."""
        shard = self._shard_of(name)
        shape, dtype = shard.shape(name), shard.dtype(name)
        return shape, dtype, dtype.itemsize * math.prod(shape)

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

    def iter_shards(self) -> Iterator[tuple[str, list[str]]]:
        by_shard: dict[str, list[str]] = {}
        for name, shard in self.weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        yield from sorted(by_shard.items())

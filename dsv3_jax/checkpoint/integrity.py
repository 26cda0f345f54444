"""Checksums of a checkpoint's arrays: written with each training step, checked wherever a step is read.

Orbax and TensorStore record none (zarr v2 has no checksum codec, OCDBT stores raw chunk bytes),
so each step carries an `integrity` item (Orbax's JSON item): {array name: checksum}, the name
Orbax gives the array in the `state` item (`ocp.tree.to_flat_dict(state, sep=".")`). A converted
checkpoint (`orbax_layout`) carries {item: {array name: checksum}}, summed over the blocks it was
written in (`checksum_block`).

The checksum of an array is sum_i mix(bits_i ^ mix(i)) mod 2**32 over its elements (i: flat C-order
index, bits: the element's bits, mix: murmur3's 32-bit finalizer, a bijection): any changed element
changes it, and a sum does not depend on how the array is cut. So it is computed on the devices by
one jitted reduction over sharded arrays at save, over restored arrays in whatever sharding they
were restored into, or over blocks read from the files (`checksum_block`), and the totals agree.

A damaged step is a `CheckpointError` naming the step, the array and the file that holds it.
"""

from __future__ import annotations

import functools
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from dsv3_jax import paths
from dsv3_jax.checkpoint.safetensors_io import CheckpointError

ITEM = "integrity"


def _mix(h):
    """murmur3's fmix32 on uint32 (wrapping arithmetic; numpy or jax arrays)."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits(x) -> jax.Array:
    """The element bits of `x` as uint32 (keys: their data; 8/16-bit types widened)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _sum(x, start_N=None, strides_N=None) -> jax.Array:
    """The checksum of `x`, or of `x` as the block of a larger array starting at index `start_N`
    whose C-order strides are `strides_N` (both traced: one program per block shape)."""
    bits = _bits(x)
    if start_N is None:
        start_N = jnp.zeros(bits.ndim, jnp.uint32)
        strides_N = jnp.array([math.prod(bits.shape[d + 1:]) % 2**32 for d in range(bits.ndim)], jnp.uint32)
    index = sum(((jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) + start_N[d]) * strides_N[d]
                 for d in range(bits.ndim)), jnp.uint32(0))
    return jnp.sum(_mix(bits ^ _mix(index)), dtype=jnp.uint32)


_sums = jax.jit(lambda leaves: [_sum(x) for x in leaves])
_block_sum = jax.jit(_sum)


def checksum_block(block: np.ndarray, shape: tuple[int, ...], offset=()) -> int:
    """`_sum` of the block `ours[offset:offset + block.shape]` of an array of `shape` (`offset`: its
    first index, missing trailing dims 0), in one compiled reduction (uint32 arithmetic wraps)."""
    block = np.atleast_1d(np.asarray(block))
    ndim = block.ndim
    start = np.array(list(offset) + [0] * (ndim - len(offset)), np.uint32)
    strides = np.array([math.prod(shape[d + 1:]) % 2**32 for d in range(ndim)], np.uint32)
    return int(_block_sum(block, start, strides))


def flat(tree) -> dict[str, object]:
    """{Orbax's array name: leaf} of a pytree."""
    return ocp.tree.to_flat_dict(tree, sep=".")


def checksums(tree) -> dict[str, int]:
    """{array name: checksum} of a pytree of (possibly sharded) arrays; every process calls it."""
    leaves = flat(tree)
    return dict(zip(leaves, (int(s) for s in jax.device_get(_sums(list(leaves.values()))))))


def read_manifest(step_dir: str) -> dict[str, int] | None:
    """The step's checksums; None for a step written before they were recorded."""
    item = paths.join(step_dir, ITEM)
    if not paths.at(item).exists():
        return None
    return ocp.JsonCheckpointHandler().restore(paths.at(item))["checksums"]


def check(step: int, item_dir: str, manifest: dict[str, int], arrays: dict[str, object]) -> None:
    """Raises for the first of `arrays` ({name: restored array}) whose checksum is not the manifest's."""
    names = [n for n in arrays if n in manifest]
    got = checksums({n: arrays[n] for n in names})
    for name in names:
        if got[name] != manifest[name]:
            raise damaged(step, item_dir, name, f"checksum {got[name]:#010x}, recorded {manifest[name]:#010x}")


def damaged(step: int | None, item_dir: str, name: str, why: str) -> CheckpointError:
    what = f"checkpoint step {step}" if step is not None else "checkpoint"
    return CheckpointError(f"{what} is damaged: array {name} in {_file_of(item_dir, name)} does not read back "
                           f"intact ({why})")


_READ_ERROR = re.compile(r"'path': '([^'/]+)/'")  # the array's folder in TensorStore's spec


def from_read_error(step: int | None, item_dir: str, error: BaseException) -> CheckpointError | None:
    """A restore's TensorStore error on a damaged file (Orbax raises a bare `Exception` whose
    message is the array's spec) as a `CheckpointError` naming the array; None for other errors."""
    found = _READ_ERROR.search(str(error))
    return damaged(step, item_dir, found.group(1), first_line(error)) if found else None


def quiet_abandoned_reads() -> None:
    """Drops the tracebacks of the reads a failed restore leaves behind, so its error stays one line;
    called before a restore starts.

    Orbax closes its event loop when one read fails. TensorStore's other reads of the step go on:
    as each finishes (on TensorStore's threads, from the moment the loop closes), its callback meets
    the closed loop, and the read coroutines Orbax dropped are collected later; Python reports both
    as unraisable. Other unraisable errors reach the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_abandoned_reads", False):
        return

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        loop_closed = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        if not (loop_closed or _READ_ERROR.search(str(error))):
            previous(unraisable)

    hook.quiets_abandoned_reads = True
    sys.unraisablehook = hook


def first_line(error: BaseException) -> str:
    text = str(error).strip().split(". See full TensorStore details")[0]
    return (text.splitlines() or [type(error).__name__])[0][:300]


def _file_of(item_dir: str, name: str) -> str:
    """The data file(s) holding array `name`: found in the OCDBT b-tree, else the array's zarr folder."""
    try:
        files = _ocdbt_files(item_dir).get(name)
    except (ValueError, OSError):
        files = None
    if not files:
        return paths.join(item_dir, name)
    return ", ".join(paths.join(item_dir, f) for f in sorted(files))


@functools.lru_cache(maxsize=8)
def _ocdbt_files(item_dir: str) -> dict[str, set[str]]:
    """{array name: data files (relative to `item_dir`)} from an OCDBT database's b-tree."""
    kv = ts.KvStore.open(paths.kvstore(item_dir)).result()
    out: dict[str, set[str]] = {}

    def walk(node: str):
        for entry in ts.ocdbt.dump(kv, node).result().get("entries", []):
            for value in entry.values():
                if isinstance(value, str) and value.startswith("btreenode:"):
                    walk(value)
            key = entry.get("key", b"")
            name, _, chunk = (key.decode() if isinstance(key, bytes) else str(key)).partition("/")
            where = entry.get("indirect_value") or (node if "inline_value" in entry else None)
            if where and not chunk.startswith("."):  # a chunk (not .zarray): value:<prefix>:<file>:<off>:<len>
                prefix, file = re.match(r"\w+:([^:]*):+([^:]+):\d+:\d+$", where).groups()
                out.setdefault(name, set()).add(prefix + file)

    for version in ts.ocdbt.dump(kv).result().get("versions", [])[-1:]:
        walk(version["root"]["location"])
    return out

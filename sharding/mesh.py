"""Device meshes with the five named axes every config uses.

Axes, outermost (slowest links: across hosts/slices) to innermost (fastest, within a chip's ICI
neighbourhood): `pipeline`, `data`, `fsdp`, `expert`, `tensor`. Sizes come from the config's
`mesh` section; at most one may be -1 and takes the devices the others leave. All meshes are
Auto-mode: parameters and batches are placed with NamedShardings, XLA propagates the rest, and
`shard_map` makes the collectives explicit where they matter (expert all-to-all, pipeline
ppermute). Explicit mode would forbid scanning over a `layers` axis sharded on `pipeline`.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh

AXES = ("pipeline", "data", "fsdp", "expert", "tensor")


class MeshError(ValueError):
    """A mesh size that cannot work for these devices, this batch, these experts or layers."""


def resolve_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Completes `sizes` (axis -> size, missing axes are 1, one may be -1) for `num_devices`."""
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise MeshError(f"unknown mesh axes {unknown}; the axes are {list(AXES)}")
    full = {axis: int(sizes.get(axis, 1)) for axis in AXES}
    free = [axis for axis, size in full.items() if size == -1]
    bad = [f"{axis}={size}" for axis, size in full.items() if size == 0 or size < -1]
    if bad:
        raise MeshError(f"mesh sizes must be positive (or -1 for one axis): {', '.join(bad)}")
    if len(free) > 1:
        raise MeshError(f"only one mesh axis may be -1, got {free}")
    fixed = math.prod(size for size in full.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise MeshError(f"mesh {_fmt(full)}: the fixed axes ({fixed} devices) do not divide the "
                            f"{num_devices} devices, so {free[0]}=-1 has no size")
        full[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(f"mesh {_fmt(full)} needs {fixed} devices but {num_devices} are available; "
                        f"change a size or set one axis to -1")
    return full


def make_mesh(sizes: Mapping[str, int], *, devices: Sequence | None = None,
              dcn_sizes: Mapping[str, int] | None = None) -> Mesh:
    """A Mesh over `devices` (default: all) with axes AXES in that order.

    `dcn_sizes` (multi-slice TPU): how many slices each axis spans; `sizes` then give the total and
    the per-slice (ICI) part is sizes / dcn_sizes, laid out by `create_hybrid_device_mesh` so that
    only the DCN part of an axis crosses slices. Put `data` or `pipeline` across slices.
    """
    devices = list(jax.devices() if devices is None else devices)
    full = resolve_sizes(sizes, len(devices))
    shape = tuple(full[a] for a in AXES)
    if not dcn_sizes:
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
    dcn = resolve_sizes(dcn_sizes, math.prod(dcn_sizes.values()))
    for axis in AXES:
        if full[axis] % dcn[axis]:
            raise MeshError(f"mesh axis {axis}={full[axis]} is not a multiple of its DCN part {dcn[axis]}")
    ici = tuple(full[a] // dcn[a] for a in AXES)
    grid = mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn[a] for a in AXES), devices)
    return Mesh(np.asarray(grid), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def abstract_mesh(sizes: Mapping[str, int], num_devices: int) -> AbstractMesh:
    """The same axes without devices: for planning (lowering for a pod this machine is not)."""
    full = resolve_sizes(sizes, num_devices)
    return AbstractMesh(tuple(full[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def check_divides(what: str, size: int, mesh: Mesh | AbstractMesh, axes: Sequence[str]) -> None:
    """Raises MeshError unless the product of `axes` divides `size` (e.g. the batch on data x fsdp)."""
    shards = math.prod(mesh.shape[a] for a in axes if a in mesh.shape)
    if size % shards:
        sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes if a in mesh.shape)
        raise MeshError(f"{what}={size} is not divisible by {sizes} ({shards} shards); change the mesh "
                        f"or {what}")


def _fmt(sizes: Mapping[str, int]) -> str:
    return "(" + ", ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) + ")"

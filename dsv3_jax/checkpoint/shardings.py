"""Logical axis names -> mesh axes, for restoring parameters straight into their shardings.

A stand-in until `sharding/` supplies the project's rules table: `rules` maps each logical axis
name (as the model's parameters carry them, see `model/params.py`) to a mesh axis or None. Mesh
axes the mesh lacks, mesh axes already used by an earlier dimension, and dimensions the mesh
axis does not divide all fall back to None (replicated along that dimension).
"""

from __future__ import annotations

from typing import Callable, Mapping, Union

from jax.sharding import Mesh, NamedSharding, PartitionSpec

DEFAULT_RULES: dict[str, str | None] = {
    "expert": "expert", "heads": "tensor", "mlp": "tensor", "vocab": "tensor", "embed": "fsdp", "layers": None,
}

Rules = Union[Mapping[str, Union[str, None]], Callable[[tuple[str, ...], tuple, tuple[int, ...]], PartitionSpec]]


def partition_spec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                   rules: Mapping[str, str | None] = DEFAULT_RULES) -> PartitionSpec:
    used, spec = set(), []
    for name, size in zip(logical, shape):
        axis = rules.get(name) if name is not None else None
        if axis is None or axis not in mesh.shape or axis in used or size % mesh.shape[axis]:
            spec.append(None)
        else:
            used.add(axis)
            spec.append(axis)
    return PartitionSpec(*spec)


def sharding_for(path: tuple[str, ...], logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                 rules: Rules | None) -> NamedSharding:
    """`rules` is a mapping (see module docstring) or a callable (path, logical axes, shape) -> spec."""
    if callable(rules):
        return NamedSharding(mesh, rules(path, logical, shape))
    return NamedSharding(mesh, partition_spec(logical, shape, mesh, DEFAULT_RULES if rules is None else rules))

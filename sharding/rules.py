"""The one table from logical axis names to mesh axes, and the presets users reach for.

Parameters name their dimensions (`embed`, `vocab`, `heads`, `head_dim`, `q_lora`, `kv_lora`,
`mlp`, `expert`, `layers`); activations use `batch`, `length`, `act_embed`, `act_heads`,
`act_vocab`. A rule maps a name to a mesh axis, a tuple of mesh axes (sharded over their product)
or None (replicated). A parameter's spec is built left to right; a mesh axis is used at most
once per array (the first dimension that claims it wins).

Fallback, by design: a dimension that its mesh axes do not divide is replicated along the axes
that do not fit (e.g. 3 MoE layers on pipeline=2, vocab 129280 on tensor=3), and mesh axes the
mesh does not have are ignored, so one table serves every mesh. `strict=True` turns such a
fallback into an error that names the array, the dimension and the axis.

Optimizer states follow their parameters: `follow_params` gives every optimizer-state leaf the
spec of the parameter at the same path (Adam's mu and nu), and scalars (counts) are replicated.
With `zero_axis` (ZeRO-1, as DeepSeek-V3 trains: `data`) each such leaf is split over that axis as
well, even where its parameter is replicated over it (`with_axis`): a device updates only its slice
of the moments, and XLA gathers the updated parameters back to their own sharding.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Mapping, Sequence, Union

import jax
from jax.sharding import NamedSharding, PartitionSpec

MeshAxes = Union[str, tuple, None]
Rules = Mapping[str, MeshAxes]

# Rows of a batch are split over every data-like axis: expert ranks hold different tokens too, and
# so do pipeline ranks outside the pipelined MoE stack (the embedding, dense layers, head and MTP run
# split over them instead of repeated on every stage). Inside the stack a stage sees all rows of its
# microbatch, so those are split over STAGE_BATCH_AXES only.
STAGE_BATCH_AXES = ("data", "fsdp", "expert")
BATCH_AXES = STAGE_BATCH_AXES + ("pipeline",)

_ACTIVATIONS: dict[str, MeshAxes] = {
    "batch": BATCH_AXES, "length": None, "act_embed": None, "act_heads": "tensor", "act_vocab": "tensor",
}

# `pipeline` as a fallback: the stacked layer axis (the first dimension) claims `pipeline` when the
# stages divide the layer count; when they do not (58 MoE layers on 16 stages), and on parameters
# with no layer axis that the stages share (embedding, head, the dense layers outside the pipelined
# stack), a later dimension takes it instead, ZeRO-style: the stage gathers what it needs each step,
# and a pipeline mesh never holds a whole copy of such a parameter on every stage.
_EXPERTS = ("expert", "pipeline")
_FSDP = ("fsdp", "pipeline")

_PARAM_AXES = ("layers", "expert", "embed", "vocab", "heads", "mlp", "q_lora", "kv_lora", "head_dim")


def _preset(**params: MeshAxes) -> dict[str, MeshAxes]:
    """The activation rules and `params`; parameter axes not named are replicated."""
    return {**_ACTIVATIONS, **dict.fromkeys(_PARAM_AXES), **params}


_ZERO3 = dict.fromkeys(("embed", "q_lora", "kv_lora", "vocab", "mlp", "heads"), "fsdp")
PRESETS: dict[str, dict[str, MeshAxes]] = {
    # ZeRO-3: every matrix sharded on its first large dim over fsdp, batch over data x fsdp.
    "fsdp": _preset(**_ZERO3),
    # FSDP inside each expert group: experts on `expert`, the rest as above.
    "fsdp_expert": _preset(**_ZERO3, expert="expert"),
    # Megatron-style: heads / hidden / vocab on `tensor`, experts on `expert`, embed on fsdp if present.
    "expert_tensor": _preset(expert="expert", heads="tensor", mlp="tensor", vocab="tensor", embed="fsdp"),
    # DeepSeek-V3's own recipe: layers on `pipeline`, experts on `expert`, data parallel beside them
    # (with the `pipeline` fallback above for what the layer axis cannot take).
    "pipeline_expert_data": _preset(layers="pipeline", expert=_EXPERTS, embed="pipeline", q_lora="pipeline",
                                    kv_lora="pipeline"),
    # Every axis at once: each preset is this table on a mesh whose other axes are 1.
    "default": _preset(layers="pipeline", expert=_EXPERTS, heads="tensor", mlp="tensor", vocab="tensor", embed=_FSDP,
                       q_lora=_FSDP, kv_lora=_FSDP),
}


class ShardingRuleError(ValueError):
    """A rule that cannot apply (strict mode, unknown preset or name)."""


def get_rules(rules: str | Rules | None) -> dict[str, MeshAxes]:
    """A preset name, a mapping (used as given) or None (the `default` preset)."""
    if rules is None:
        rules = "default"
    if isinstance(rules, str):
        if rules not in PRESETS:
            raise ShardingRuleError(f"unknown sharding preset {rules!r}; presets: {sorted(PRESETS)}")
        return dict(PRESETS[rules])
    return dict(rules)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("sharding_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: str | Rules | None):
    """The rules a program traced inside this block is partitioned by (beside `jax.set_mesh`): a
    scanned layer stack constrains each layer's weights to them, so a layer's weights are gathered
    inside the loop, one layer at a time, not the whole stack before it. jax's trace cache does not
    see the rules: trace a jitted function under one set of rules only."""
    token = _ACTIVE.set(get_rules(rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> dict[str, MeshAxes] | None:
    """The rules of the innermost `use_rules` block, or None outside one."""
    return _ACTIVE.get()


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh, rules: Rules, *,
                    strict: bool = False, name: str = "array") -> PartitionSpec:
    """PartitionSpec for an array with these logical axes and shape (see the module docstring)."""
    if len(logical) != len(shape):
        raise ShardingRuleError(f"{name}: logical axes {tuple(logical)} and shape {tuple(shape)} differ in rank")
    used: set[str] = set()
    spec = []
    for dim, (axis_name, size) in enumerate(zip(logical, shape)):
        if axis_name is not None and axis_name not in rules:
            raise ShardingRuleError(f"{name}: logical axis {axis_name!r} has no rule; add it to the rules table")
        chosen, shards = [], 1
        for mesh_axis in _as_tuple(rules.get(axis_name) if axis_name is not None else None):
            n = mesh.shape.get(mesh_axis, 1)
            if n == 1 or mesh_axis in used:  # absent, or an earlier dimension claimed it (by design)
                continue
            if size % (shards * n):
                if strict:
                    raise ShardingRuleError(f"{name}: dimension {dim} ({axis_name!r}, size {size}) cannot be "
                                            f"sharded on mesh axis {mesh_axis!r} of size {n}")
                continue
            chosen.append(mesh_axis)
            shards *= n
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def named_sharding(logical, shape, mesh, rules: Rules, **kwargs) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical, shape, mesh, rules, **kwargs))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shards_of(spec: PartitionSpec, mesh) -> int:
    """Number of distinct pieces an array with this spec is cut into."""
    return math.prod(mesh.shape[a] for entry in spec for a in _as_tuple(entry))


def with_axis(spec: PartitionSpec, shape: Sequence[int], mesh, axis: str) -> PartitionSpec:
    """`spec` split further over mesh axis `axis`, on the first dimension whose shards it divides
    (added after the axes already there, so each new shard lies inside one of the old ones); `spec`
    as is when the mesh has no such axis, the spec already uses it, or no dimension divides."""
    n = mesh.shape.get(axis, 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if n == 1 or any(axis in _as_tuple(e) for e in entries):
        return spec
    for dim, (entry, size) in enumerate(zip(entries, shape)):
        if size % (math.prod(mesh.shape[a] for a in _as_tuple(entry)) * n) == 0:
            entries[dim] = axis if entry is None else (*_as_tuple(entry), axis)
            return PartitionSpec(*entries)
    return spec


def follow_params(tree: Any, param_shardings: Mapping, mesh, zero_axis: str | None = None) -> Any:
    """Shardings for `tree` (e.g. an optimizer state): a leaf whose key path ends with a parameter's
    path and has its shape takes that parameter's sharding, split further over `zero_axis` when
    given (ZeRO-1, `with_axis`); any other leaf is replicated.

    `param_shardings` maps parameter key paths (tuples of str) to (shape, NamedSharding).
    """
    def for_leaf(path, leaf):
        keys = tuple(key_name(k) for k in path)
        for start in range(len(keys)):
            hit = param_shardings.get(keys[start:])
            if hit is not None and tuple(hit[0]) == tuple(getattr(leaf, "shape", ())):
                if zero_axis is None:
                    return hit[1]
                return NamedSharding(mesh, with_axis(hit[1].spec, hit[0], mesh, zero_axis))
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(for_leaf, tree)


def key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)

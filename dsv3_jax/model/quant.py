"""Quantized weights in the model: which projections a format covers, and the variable type that
holds them.

A quantized projection is a `QuantizedWeight` variable whose value is a `QArray`
(dsv3_jax/ops/quant.py) in place of the `nnx.Param`; the modules read it as they read any weight
(`self.w1[...]`) and the ops (`ops/linear.project`, `ops/dispatch`) dequantise inside the matmul,
so generation, serving and evaluation run the one forward. Targets:

- `experts`: the routed experts' w1 / w3 / w2 (MoE layers and MTP blocks), int8/int4's default;
- `all`: every projection the released FP8 checkpoint stores in FP8 (MLA, dense and shared MLPs,
  routed experts), FP8's default. Embedding, head, norms, router and MTP's `eh_proj` stay as they are.
"""

from __future__ import annotations

from typing import Iterator

import jax
from flax import nnx

from dsv3_jax.model import params
from dsv3_jax.ops import quant

TARGETS = ("experts", "all")
STACK_AXES = ("layers", "expert")


class QuantizedWeight(nnx.Variable):
    """A frozen quantized projection (value: a `QArray`). Not an `nnx.Param`: no optimizer sees it."""


def default_targets(fmt: str) -> str:
    return "all" if fmt == "fp8" else "experts"


def check_targets(targets: str) -> str:
    if targets not in TARGETS:
        raise ValueError(f"quantize={targets!r} is not a target set; expected one of {TARGETS}")
    return targets


def targets(model: nnx.Module, which: str) -> Iterator[tuple[tuple[str, ...], nnx.Module, str, int]]:
    """(variable path, owning module, attribute name, contracted axes) of every projection `which`
    covers (`experts`: those with an `expert` axis); the contracted axes follow the stack axes."""
    check_targets(which)
    for path, node, name, contract in params.projections(model):
        if which == "all" or "expert" in params.logical_axes(getattr(node, name)):
            yield path, node, name, contract


def stack_dims(axes: tuple, names: tuple = STACK_AXES) -> int:
    """Leading logical axes in `names`: by default those that index whole matrices (layers of a
    stack, experts)."""
    n = 0
    while n < len(axes) and axes[n] in names:
        n += 1
    return n


def physical_axes(axes: tuple, fmt: str, contract: int) -> tuple[tuple, tuple]:
    """Logical axes of (q, scale) for a weight with logical `axes`: the stack axes, then the first
    contraction axis's name for K and the first output axis's for N (fp8: [N, K] order)."""
    s = stack_dims(axes)
    k_name, n_name = axes[s], axes[s + contract]
    two = (n_name, k_name) if fmt == "fp8" else (k_name, n_name)
    return tuple(axes[:s]) + two, tuple(axes[:s]) + two


def quantize_model(model: nnx.Module, fmt: str, which: str | None = None, group: int = 128) -> nnx.Module:
    """Quantizes `model`'s projections in place (held arrays, one leaf at a time): for models built
    or loaded in memory; `load_pretrained(weights=...)` builds the quantized leaves per shard instead."""
    quant.check_format(fmt)
    for path, module, name, contract in list(targets(model, which or default_targets(fmt))):
        var = getattr(module, name)
        if isinstance(var, QuantizedWeight):
            continue
        axes = params.logical_axes(var)
        qa = quant.quantize(var[...], fmt, contract=contract, stack=stack_dims(axes), group=group,
                            name=".".join(path), scale_fmt=model.config.scale_fmt)
        setattr(module, name, QuantizedWeight(qa, logical_axes=axes))
    return model


def dequantize_model(model: nnx.Module, dtype) -> nnx.Module:
    """Every `QuantizedWeight` of `model` back to an `nnx.Param` in `dtype`, in place: the model the
    quantized one approximates (the reference of its tests)."""
    for _, node, name, _ in params.projections(model):
        var = getattr(node, name)
        if isinstance(var, QuantizedWeight):
            setattr(node, name, nnx.Param(quant.dequantize(var[...], dtype), logical_axes=params.logical_axes(var)))
    return model


def parameter_bytes(model: nnx.Module) -> int:
    """Bytes of every array the model holds (quantized values and their scales included)."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(model)))


def format_of(model: nnx.Module) -> str | None:
    """The quantized format the model's weights are held in, or None."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, QuantizedWeight):
            return node[...].fmt
    return None


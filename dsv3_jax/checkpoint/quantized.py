"""Quantized parameters built shard by shard as they load (`load_pretrained(weights=...)`), and
the blocks `convert --quantize` writes, with the same arithmetic (`Blocks`).

Each quantized projection becomes two arrays, q and scale (dsv3_jax/ops/quant.py), each made with
`build_array` (the loader's per-shard builder of every parameter): a device's block of q or of the
scales is quantized on the host from the source window that covers it, widened to whole scale
groups (int) or 128x128 blocks (FP8), one stack element ([layer] or [layer, expert]) at a time.
So no process holds more than one matrix's window in float32, never a whole leaf, and nothing is
dequantised on the devices. Stored FP8 (an HF FP8 folder, a `--keep-fp8` checkpoint) loaded as
`fp8` is copied as it is: e4m3 windows and the scale blocks, never widened.

Sources give one stack element's matrix in our orientation [K, N] (`src`, float32) and, where the
source holds FP8, its e4m3 [N, K] and scale windows (`raw`). The windows are quantized with numpy
(`xp=np`: the converter's arithmetic, also for HF folders and converted checkpoints) or with the
jnp quantizers (`xp=jnp`: a training run's weights, quantized as `quantize_model` quantizes the
trained model in memory, which XLA rounds its scales' divisions differently from numpy).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.checkpoint import fp8
from dsv3_jax.checkpoint.hf_reader import index_bounds
from dsv3_jax.model import quant as model_quant
from dsv3_jax.model.params import logical_axes
from dsv3_jax.model.quant import physical_axes, stack_dims
from dsv3_jax.ops import quant
from dsv3_jax.ops.quant import QArray

# (stack index, K rows, N cols) -> float32 [K rows, N cols] of our matrix
Source = Callable[[tuple[int, ...], slice, slice], np.ndarray]
# (stack index, "q" | "scale", rows, cols) -> that window of the stored e4m3 [N, K] or its scale_inv; None: not FP8
RawFp8 = Callable[[tuple[int, ...], str, slice, slice], np.ndarray] | None


def _widen(s: slice, unit: int, limit: int) -> slice:
    return slice(s.start // unit * unit, min(limit, -(-s.stop // unit) * unit))


@dataclasses.dataclass
class Blocks:
    """`blocks(part, shape, index)`: the block `index` of the q (`part="q"`) or scale array (of
    `shape`, `quant.physical_shapes`) of one weight whose stack elements are K x N matrices, each
    element's window quantized from `src` (or, FP8 from `raw`, copied as stored), widened to whole
    groups (int) or 128x128 blocks (fp8). The loader's shards and the converter's chunks alike; the
    last window's (q, scale) is kept, so the converter's scale block after its q block costs nothing."""

    fmt: str
    group: int  # K rows per scale (fp8: the 128 block)
    stacked: int  # leading stack dims: [layer] or [layer, expert]
    k: int
    n: int
    src: Source = None
    raw: RawFp8 = None
    xp: Any = np  # np: the converter's arithmetic; jnp: `quantize_model`'s (a run's weights)
    pow2: bool = False  # fp8 scales as powers of two (UE8M0)
    _last: tuple = dataclasses.field(default=(None, None), init=False, repr=False)

    def __call__(self, part: str, shape: tuple[int, ...], index) -> np.ndarray:
        bounds = index_bounds(index, shape)
        rows, cols = bounds[self.stacked:]
        out = None
        for stack in itertools.product(*(range(b.start, b.stop) for b in bounds[:self.stacked])):
            window = self._fp8_window if self.fmt == "fp8" else self._int_window
            w = window(part, rows, cols, stack)
            if out is None:
                out = np.empty([b.stop - b.start for b in bounds[:self.stacked]] + list(w.shape), w.dtype)
            out[tuple(i - b.start for i, b in zip(stack, bounds))] = w
        return out

    def _quantized(self, stack, rows: slice, cols: slice) -> tuple[np.ndarray, np.ndarray]:
        """(q, scales) of one stack element's window: int of K rows `rows` (whole groups) x N columns
        `cols` of the [K, N] matrix; fp8 of rows x cols (whole 128x128 blocks, edge blocks partial) of
        its HF orientation [N, K]."""
        key = (stack, rows.start, rows.stop, cols.start, cols.stop)
        if self._last[0] == key:
            return self._last[1]
        if self.fmt != "fp8":
            q, s = quant.quantize_int(self.xp.asarray(self.src(stack, rows, cols)), self.fmt, self.group, xp=self.xp)
        elif self.xp is np:
            q, s = fp8.quantize(np.ascontiguousarray(self.src(stack, cols, rows).T), pow2=self.pow2)
        else:
            q, s = quant.quantize_128x128(jnp.asarray(np.ascontiguousarray(self.src(stack, cols, rows).T)),
                                          pow2_scale=self.pow2, min_amax=quant.FP8_MIN_AMAX)
        self._last = (key, (np.asarray(q), np.asarray(s)))
        return self._last[1]

    def _int_window(self, part: str, rows: slice, cols: slice, stack) -> np.ndarray:
        """Rows `rows` x cols of q (int8 [K, N] or packed [K/2, N]) or of the scales [K/g, N]."""
        g = self.group
        per_group = g // 2 if (part == "q" and self.fmt == "int4") else (g if part == "q" else 1)
        groups = slice(rows.start // per_group, -(-rows.stop // per_group))
        q, s = self._quantized(stack, slice(groups.start * g, groups.stop * g), cols)
        first = groups.start * per_group
        return (q if part == "q" else s)[rows.start - first:rows.stop - first]

    def _fp8_window(self, part: str, rows: slice, cols: slice, stack) -> np.ndarray:
        """rows x cols of the e4m3 [N, K] (`q`) or of its block scales [NB, KB] (`scale`)."""
        if self.raw is not None:
            return self.raw(stack, part, rows, cols)
        b, n, k = fp8.BLOCK, self.n, self.k
        nr, kc = (_widen(rows, b, n), _widen(cols, b, k)) if part == "q" else (
            slice(rows.start * b, min(n, rows.stop * b)), slice(cols.start * b, min(k, cols.stop * b)))
        q, s = self._quantized(stack, nr, kc)
        if part == "q":
            return q[rows.start - nr.start:rows.stop - nr.start, cols.start - kc.start:cols.stop - kc.start]
        return s


def build_array(shape: tuple[int, ...], dtype, where, shard) -> jax.Array:
    """The global array `shape` with sharding `where`, each of this process's devices given
    `shard(index)` (a numpy block of ours[index]): what `jax.make_array_from_callback` does, but one
    block at a time, copied to the devices that hold it (replicas share one read) and dropped before
    the next is made, so the host never holds more than one block of a parameter."""
    by_index: dict = {}
    for device, index in where.addressable_devices_indices_map(tuple(shape)).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        by_index.setdefault(key, (index, []))[1].append(device)
    arrays = []
    for index, devices in by_index.values():
        block = np.asarray(shard(index), dtype)
        arrays += [jax.device_put(block, d) for d in devices]
        del block
    return jax.make_array_from_single_device_arrays(tuple(shape), where, arrays)


class Quantization:
    """What `load_pretrained(weights=...)` asks for: the format, the projections it covers (`targets`
    of dsv3_jax/model/quant.py) and the int group; `plan(model)` maps each covered variable path to
    (owning module, attribute, contracted axes), `build` puts one of them on its module quantized."""

    def __init__(self, weights: str, targets: str | None = None, group: int = 128):
        self.fmt = quant.check_format(weights)
        self.targets = model_quant.check_targets(targets or model_quant.default_targets(self.fmt))
        if group <= 0:
            raise ValueError(f"quant_group={group} must be positive")
        self.group = group
        self.scale_fmt = None  # the model's FP8 scale format (V3.1: "ue8m0"), set by `plan`

    def plan(self, model) -> dict:
        self.scale_fmt = model.config.scale_fmt
        return {path: (module, name, contract) for path, module, name, contract in
                model_quant.targets(model, self.targets)}

    def build(self, plan_entry, var, path: tuple[str, ...], place, src: Source = None, raw: RawFp8 = None, xp=np,
              stored=None) -> None:
        """`var` (abstract: shape and logical axes) set on its module as a QArray whose q and scale are
        each built per shard in `place(axes, shape, name)`'s sharding from `src` / `raw`, quantized
        with `xp` (fp8 with the model's `scale_fmt`: "ue8m0" makes power-of-two scales; `raw` ones
        are kept as stored). `stored`: the (q, scale) arrays `convert --quantize` wrote (int
        formats), each device's shard read from them as it is (tensorstore windows)."""
        module, attr, contract = plan_entry
        fmt, name, axes = self.fmt, ".".join(path), logical_axes(var)
        st = stack_dims(axes)
        stack_shape, slice_shape = tuple(var.shape[:st]), tuple(var.shape[st:])
        k, n = math.prod(slice_shape[:contract]), math.prod(slice_shape[contract:])
        g = quant.FP8_BLOCK if fmt == "fp8" else quant.group_for(k, self.group, fmt, name)

        blocks = Blocks(fmt, g, st, k, n, src, raw, xp, self.scale_fmt == "ue8m0")
        arrays = []
        shapes, part_axes = quant.physical_shapes(fmt, stack_shape, k, n, g), physical_axes(axes, fmt, contract)
        for part, (shape, dtype), p_axes, store in zip(("q", "scale"), shapes, part_axes, stored or (None, None)):
            if store is None:
                shard = functools.partial(blocks, part, shape)
            elif tuple(store.shape) != tuple(shape):
                raise ValueError(f"{name}.{part} is stored with shape {tuple(store.shape)}; {fmt} group {g} needs "
                                 f"{shape}")
            else:
                shard = lambda index, store=store: store[tuple(index)].read().result()  # noqa: E731
            arrays.append(build_array(shape, np.dtype(dtype), place(p_axes, shape, f"{name}.{part}"), shard))
        qa = QArray(*arrays, fmt, slice_shape, contract, g, self.scale_fmt if fmt == "fp8" else None)
        setattr(module, attr, model_quant.QuantizedWeight(qa, logical_axes=logical_axes(var)))


def ours_2d(read: Callable[[tuple], np.ndarray], slice_shape: tuple[int, ...], contract: int) -> Source:
    """A `Source` over an array stored in our layout [*stack, *slice_shape]: `read(index)` reads a
    window of it. K rows map to the covering range of the first contraction axis (whole trailing
    axes), so the read is one block of that stack element."""
    inner = math.prod(slice_shape[1:contract]) if contract > 1 else 1
    n = math.prod(slice_shape[contract:])

    def src(stack, rows: slice, cols: slice) -> np.ndarray:
        r0, r1 = rows.start // inner, -(-rows.stop // inner)
        block = np.asarray(read(tuple(stack) + (slice(r0, r1),)), np.float32).reshape(-1, n)
        return block[rows.start - r0 * inner:rows.stop - r0 * inner, cols]

    return src


def hf_2d(window: Callable) -> Source:
    """A `Source` over an HF tensor [N, K] ([out, in], FP8 dequantised by the window)."""
    return lambda stack, rows, cols: window(stack, cols, rows).T


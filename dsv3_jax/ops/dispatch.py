"""Routed experts, dropless: sort (token, slot) rows by expert, a grouped SwiGLU, combine.

Letters: N tokens, K experts per token, M = N*K sorted rows, E experts, D model, F expert hidden,
R received rows (expert parallelism), r adapter rank.

One entry, `grouped_expert_mlp(x_sorted, group_sizes, weights)`, and one place that picks how it
runs (`_choose`), for the platform the program is lowered for (`jax.lax.platform_dependent`):
- TPU/GPU: `jax.lax.ragged_dot`, sparse there, each projection through the grouped kernel the
  weights' type asks for: float weights ragged_dot, `fp8=True` (the FP8 training recipe) or stored
  FP8 experts the block-scaled FP8 grouped kernel (dsv3_jax/ops/linear.py), int8/int4 experts the
  Pallas kernel that dequantises one weight tile at a time (pallas_kernels/quant_grouped_matmul.py).
- CPU: XLA:CPU computes ragged_dot as if every row met every expert (docs/numerics.md), so a
  training layer's float experts without adapters take the padded groups (ops/padded_groups.py)
  and everything else the tile loop (ops/tile_loop.py). The FP8 kernels keep their FP8 numerics
  on every platform (through their jnp twins on CPU).
`impl` forces one path ("ragged", "tiled", "padded", or "dense": `dense_reference`, every row
through every expert, O(E), for tests); "auto" is the platform's choice.

Expert LoRA: `adapters`, six arrays (a1 [E, D, r], b1 [E, r, F], a3 [E, D, r], b3 [E, r, F],
a2 [E, F, r], b2 [E, r, D]), add to each of a row's projections its own expert's low-rank update,
x W_e + scale * (x A_e) B_e, inside the grouped matmul (ragged_dot with the stacked A and B, or
read per tile by the tile loop), in the compute dtype beside any kernel. `masks` (adapter dropout,
`adapter_masks`) multiply the adapters' inputs per sorted row.

Quantized experts (`QArray`) are frozen (inference, QLoRA): gradients reach x and the adapters.
No path but the dense reference holds every expert of a layer in the compute dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv3_jax.ops import linear, padded_groups, quant, tile_loop
from dsv3_jax.ops.quant import QArray
from pallas_kernels.quant_grouped_matmul import quant_grouped_matmul
from sharding.expert_parallel import combine

IMPLS = ("auto", "ragged", "tiled", "padded", "dense")


class SortedRows(NamedTuple):
    token_M: jax.Array  # int32 token index of each sorted row
    order_M: jax.Array  # int32 position of each sorted row in the flattened [N*K] (token, slot) list
    group_sizes_E: jax.Array  # int32 rows per expert


def sort_by_expert(experts_NxK: jax.Array, num_experts: int) -> SortedRows:
    """Rows sorted by expert; an expert id of `num_experts` (padding) sorts last, in no group."""
    flat = experts_NxK.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")
    return SortedRows(order // experts_NxK.shape[1], order, sizes)


def kernel_ready(weights) -> bool:
    """Whether int-quantized experts fit the Pallas kernel (groups of a multiple of 32 rows)."""
    return all(isinstance(w, QArray) and w.fmt in ("int8", "int4") and w.group % 32 == 0 for w in weights)


def _grouped_mm(lhs_MxK, w, sizes_E, fp8: bool = False):
    """lhs_m w_{e(m)} in lhs's dtype, fp32 accumulation, by the weights' type (module docstring)."""
    if isinstance(w, QArray) and w.fmt == "fp8":
        return linear.fp8_matmul_stored(lhs_MxK, w.q, w.scale, sizes_E, lhs_MxK.dtype, w.scale_fmt)
    if isinstance(w, QArray):
        return quant_grouped_matmul(lhs_MxK, w.q, w.scale, sizes_E, fmt=w.fmt, group=w.group, out_dtype=lhs_MxK.dtype)
    if fp8:
        return linear.fp8_matmul(lhs_MxK, w, sizes_E, lhs_MxK.dtype)
    return jax.lax.ragged_dot(lhs_MxK, w, sizes_E, preferred_element_type=jnp.float32).astype(lhs_MxK.dtype)


def _ragged_mlp(x_MxD, sizes_E, weights, adapters=(), lora_scale: float = 1.0, masks=(), fp8: bool = False):
    def proj(lhs, w, i):  # lhs W_e (+ scale * (lhs m_i A_e) B_e), each row with its own expert's matrices
        y = _grouped_mm(lhs, w, sizes_E, fp8)
        if not adapters:
            return y
        u = _grouped_mm(lhs * masks[i] if masks else lhs, adapters[2 * i], sizes_E)
        return y + lora_scale * _grouped_mm(u, adapters[2 * i + 1], sizes_E)

    w1_ExDxF, w3_ExDxF, w2_ExFxD = weights
    return proj(tile_loop.swiglu(proj(x_MxD, w1_ExDxF, 0), proj(x_MxD, w3_ExDxF, 1)), w2_ExFxD, 2)


def dense_reference(x_MxD, sizes_E, weights, adapters=(), lora_scale: float = 1.0, masks=()):
    """Every row through every expert (a quantized stack dequantised whole), then each row's own:
    the readable reference the tests hold the other paths to. Rows of no expert take the last's."""
    def mm(eq, lhs, w):
        return jnp.einsum(eq, lhs, quant.as_dense(w, lhs.dtype), preferred_element_type=jnp.float32).astype(lhs.dtype)

    def proj(eqs, lhs, w, i):  # every row through every expert's W (+ scale * (lhs m_i A) B)
        y = mm(eqs[0], lhs, w)
        if not adapters:
            return y
        dropped = lhs if not masks else lhs * (masks[i] if lhs.ndim == 2 else masks[i][:, None])
        return y + lora_scale * mm(eqs[2], mm(eqs[1], dropped, adapters[2 * i]), adapters[2 * i + 1])

    up_eqs = ("MD,EDF->MEF", "MD,EDr->MEr", "MEr,ErF->MEF")
    h_MxExF = tile_loop.swiglu(proj(up_eqs, x_MxD, weights[0], 0), proj(up_eqs, x_MxD, weights[1], 1))
    y_MxExD = proj(("MEF,EFD->MED", "MEF,EFr->MEr", "MEr,ErD->MED"), h_MxExF, weights[2], 2)
    expert_M = jnp.minimum(tile_loop.expert_and_slot(sizes_E, x_MxD.shape[0])[0], sizes_E.shape[0] - 1)
    return jnp.take_along_axis(y_MxExD, expert_M[:, None, None], axis=1)[:, 0]


def adapter_masks(lora_dropout, m: int, d: int, f: int, dtype) -> tuple:
    """Inverted-dropout multipliers of the three expert adapters' inputs, one row per sorted row:
    ([M, D], [M, D], [M, F]), 1 / (1 - rate) kept, 0 dropped, Bernoulli(1 - rate) drawn from each
    adapter's key over the sorted rows (so a step's key gives the same masks on every run of it).
    `lora_dropout`: (rate, key data [2] of w1's, w3's and w2's adapter), or None: ()."""
    if lora_dropout is None:
        return ()
    rate, *keys = lora_dropout
    return tuple(jnp.where(jax.random.bernoulli(jax.random.wrap_key_data(k), 1.0 - rate, (m, n)),
                           1.0 / (1.0 - rate), 0.0).astype(dtype) for k, n in zip(keys, (d, d, f)))


def _choose(weights, adapters, layer, masks, impl: str, fp8: bool, sparse_rows: bool) -> tuple[str, str]:
    """(CPU path, TPU/GPU path): the one place the implementation is chosen (module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown moe impl {impl!r}; expected one of {IMPLS}")
    if len(adapters) not in (0, 6):
        raise ValueError(f"expert adapters are six arrays (a1, b1, a3, b3, a2, b2), got {len(adapters)}")
    fmt = next((w.fmt for w in weights if isinstance(w, QArray)), None)
    if impl == "padded" and (fmt or adapters or layer is not None):
        raise ValueError("impl='padded' runs one layer's float experts without adapters; use 'tiled'")
    if (fp8 and fmt is None) or (fmt == "fp8" and impl not in ("dense", "tiled")):
        return "ragged", "ragged"  # the FP8 kernels on every platform
    if fmt and impl in ("auto", "ragged") and not kernel_ready(weights):
        return "tiled", "tiled"  # int experts the Pallas kernel cannot take
    if impl != "auto":
        return impl, impl
    plain = fmt is None and not adapters and layer is None and not masks and not sparse_rows
    return ("padded" if plain else "tiled"), "ragged"


def grouped_expert_mlp(x_MxD: jax.Array, group_sizes_E: jax.Array, weights, adapters=(), *, impl: str = "auto",
                       fp8: bool = False, max_tile: int = 128, layer=None, lora_scale: float = 1.0,
                       masks=(), sparse_rows: bool = False) -> jax.Array:
    """SwiGLU of each sorted row through its expert, w2(silu(x w1) * x w3): [M, D] in x's dtype.

    x_MxD: rows sorted by expert, `group_sizes_E` of each (rows past their sum belong to no expert
    and give zero). `weights` (w1 [E, D, F], w3 [E, D, F], w2 [E, F, D]) float or `QArray`, or
    layer stacks [L, E, ...] with `layer` (the tile loop reads those in place, the others slice
    the layer first). `sparse_rows`: most rows may be past sum(group_sizes_E) (the expert-parallel
    receive buffer), so CPU takes the tile loop, whose work follows the grouped rows alone.
    `adapters`, `lora_scale`, `masks`, `impl`, `fp8`: module docstring."""
    cpu, accelerator = _choose(weights, adapters, layer, masks, impl, fp8, sparse_rows)
    lora = dict(adapters=adapters, lora_scale=lora_scale, masks=masks)

    def one_layer():  # the paths but the tile loop slice a layer stack first
        return weights if layer is None else tuple(w[layer].astype(x_MxD.dtype) for w in weights)

    paths = {"tiled": lambda: tile_loop.tiled_mlp(x_MxD, group_sizes_E, weights, max_tile, layer, **lora),
             "padded": lambda: padded_groups.padded_groups_mlp(x_MxD, group_sizes_E, weights, max_tile),
             "ragged": lambda: _ragged_mlp(x_MxD, group_sizes_E, one_layer(), **lora, fp8=fp8),
             "dense": lambda: dense_reference(x_MxD, group_sizes_E, one_layer(), **lora)}
    if cpu == accelerator:
        return paths[cpu]()
    return jax.lax.platform_dependent(cpu=paths[cpu], default=paths[accelerator])


def routed_experts(x_NxD: jax.Array, experts_NxK: jax.Array, weights_NxK: jax.Array, w1_ExDxF, w3_ExDxF, w2_ExFxD,
                   *adapters: jax.Array, lora_dropout=None, **options) -> jax.Array:
    """sum_k weights[n, k] * Expert_{experts[n, k]}(x[n]): [N, D] in x's dtype. `lora_dropout` (rate,
    three keys) drops the adapters' inputs per sorted row (`adapter_masks`); `options` and the
    weights as in `grouped_expert_mlp`."""
    rows = sort_by_expert(experts_NxK, w1_ExDxF.shape[-3])
    x_MxD = x_NxD[rows.token_M]
    masks = adapter_masks(lora_dropout if adapters else None, *x_MxD.shape, w1_ExDxF.shape[-1], x_MxD.dtype)
    y_MxD = grouped_expert_mlp(x_MxD, rows.group_sizes_E, (w1_ExDxF, w3_ExDxF, w2_ExFxD), adapters, masks=masks,
                               **options)
    return combine(jnp.zeros_like(y_MxD).at[rows.order_M].set(y_MxD), weights_NxK, x_NxD.dtype)


def local_expert_mlp(x_RxD: jax.Array, expert_R: jax.Array, valid_R: jax.Array, w1_ExDxF, w3_ExDxF, w2_ExFxD,
                     *adapters: jax.Array, **options) -> jax.Array:
    """Expert-parallel receive side: row r through its local expert (one expert per row, K = 1).

    Rows with `valid_R` False are padding from the all-to-all: they sort after every expert's rows
    in no group, so no grouped path computes them, and their outputs are zero. `adapters` and
    `options` as in `grouped_expert_mlp`."""
    e = w1_ExDxF.shape[0]
    rows = sort_by_expert(jnp.where(valid_R, expert_R, e)[:, None], e)
    y_MxD = grouped_expert_mlp(x_RxD[rows.token_M], rows.group_sizes_E, (w1_ExDxF, w3_ExDxF, w2_ExFxD), adapters,
                               sparse_rows=True, **options)
    return jnp.where(valid_R[:, None], jnp.zeros_like(y_MxD).at[rows.order_M].set(y_MxD), 0)

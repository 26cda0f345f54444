"""Dropless expert dispatch: sort (token, slot) rows by expert, grouped SwiGLU, combine.

Letters: N tokens, K experts per token, M = N*K sorted rows, E experts, D model, F expert hidden,
J row tiles, t rows per tile.

Three grouped-matmul implementations compute the same function:
- `ragged`: `jax.lax.ragged_dot`, sparse on TPU/GPU. XLA:CPU computes it as if every row met every
  expert (docs/numerics.md, Backend facts), so it is not used on CPU by default.
- `tiled`: rows padded per expert to a multiple of a tile, a loop over tiles runs each through its
  expert's weights read in place (`tile_loop_swiglu`, its own backward). Cost ~ (M + E*t) rows; `t`
  is chosen so that E*t <= M, so compute and memory follow the activated experts, not the total.
- `capacity`: each expert's first C = 1.25 x M / E (token, slot) pairs gathered straight from the
  tokens into [E, C, D], three batched matmuls, the gate-weighted sum gathered back; the rest
  through the tile loop (`_capacity_routed`, dsv3_jax/ops/capacity.py). `auto` on CPU for a
  training layer's float experts without adapters, where XLA:CPU runs it faster than the tile loop.
- `dense`: every row through every expert, then select. The readable reference, O(E) cost.
- `fp8`: the FP8 block-scaled grouped kernel (`ModelConfig.fp8_matmul`), Dgrad and Wgrad in FP8 too.
- `pallas`: int8/int4 quantized experts through `pallas_kernels.quant_grouped_matmul` (dequantised
  per weight tile; `auto` picks it off CPU for such experts), expert adapters beside it through
  ragged_dot; its backward (QLoRA) gives x the gradient through the dequantised weights.

Expert LoRA: `adapters`, six arrays (a1 [E, D, r], b1 [E, r, F], a3 [E, D, r], b3 [E, r, F],
a2 [E, F, r], b2 [E, r, D]), add to each of a row's three projections its own expert's low-rank
update, x W_e + scale * (x A_e) B_e, inside the grouped matmul: ragged_dot with the stacked A and
B, the tile loop reading tile j's expert's A and B beside its weights (and adding their gradients
into that expert's slot), the dense reference through every expert's adapter, then select.
Adapters are per layer ([E, ...]) even where the weights are a layer stack read at `layer`. The
kernel paths (FP8, int8/int4 Pallas) run them beside the kernel through ragged_dot, in the compute
dtype.

Quantized experts (`dsv3_jax.ops.quant.QArray`, frozen: inference, and QLoRA whose gradients reach
x and the adapters; the tile loop's backward gives the weights a zero cotangent, the Pallas int
kernel and the stored-FP8 kernel have backwards for x alone): the tile loop dequantises its
tile's expert, ragged_dot walks K one scale group at a time over every expert, the dense reference
dequantises the stack; stored FP8 experts run the block-scaled grouped kernel on their own blocks.
No path holds every expert of a layer in the compute dtype except the dense reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.ops import capacity, quant
from dsv3_jax.ops.quant import QArray
from sharding.expert_parallel import combine


class SortedRows(NamedTuple):
    token_M: jax.Array  # int32 token index of each sorted row
    expert_M: jax.Array  # int32 expert of each sorted row (non-decreasing)
    order_M: jax.Array  # int32 position of each sorted row in the flattened [N*K] (token, slot) list
    group_sizes_E: jax.Array  # int32 rows per expert


def sort_by_expert(experts_NxK: jax.Array, num_experts: int) -> SortedRows:
    flat = experts_NxK.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return SortedRows(order // experts_NxK.shape[1], flat[order], order, sizes)




def tile_rows(num_rows: int, num_experts: int, max_tile: int) -> int:
    """Largest power of two <= max_tile with num_experts * tile <= num_rows (at least 8)."""
    tile = 8
    while tile * 2 <= max_tile and num_experts * tile * 2 <= num_rows:
        tile *= 2
    return tile


def overflow_tile_rows(num_rows: int, num_experts: int, max_tile: int) -> int:
    """Rows per tile for the rows past the capacity path's C: the power of two at or above
    sqrt(num_rows / num_experts), in [8, max_tile] (such remainders are a few rows per expert)."""
    return min(max_tile, max(8, 1 << max(0, int(np.ceil(np.log2(np.sqrt(num_rows / num_experts)))))))


def _swiglu(gate, up):
    return jax.nn.silu(gate.astype(jnp.float32)).astype(up.dtype) * up


def _ragged_quantized(lhs_MxK, w: QArray, sizes_E):
    """ragged_dot through int-quantized experts one K group at a time: each step dequantises rows
    [j*g, (j+1)*g) of every expert (never all of an expert stack in the compute dtype)."""
    g, m = w.group, lhs_MxK.shape[0]

    def step(j, acc):
        lhs = jax.lax.dynamic_slice_in_dim(lhs_MxK, j * g, g, axis=1)
        return acc + jax.lax.ragged_dot(lhs, quant.group_slice(w, j, lhs_MxK.dtype), sizes_E,
                                        preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, w.k // g, step, jnp.zeros((m, w.n), jnp.float32))
    return acc.astype(lhs_MxK.dtype)


def _ragged_mm(lhs_MxK, rhs, sizes_E):
    if isinstance(rhs, QArray):
        return _ragged_quantized(lhs_MxK, rhs, sizes_E)
    return jax.lax.ragged_dot(lhs_MxK, rhs, sizes_E, preferred_element_type=jnp.float32).astype(lhs_MxK.dtype)


def _ragged_mlp(x_MxD, sizes_E, w1_ExDxF, w3_ExDxF, w2_ExFxD, *adapters, lora_scale: float = 1.0, masks=(),
                weight_mm=_ragged_mm):
    """The grouped SwiGLU, each projection `weight_mm(lhs, w, sizes)`: ragged_dot (a quantized stack
    one K group at a time), or a kernel (`_kernel_quantized`, `_fp8_mm`); adapters through ragged_dot."""
    def proj(lhs, w, i):  # lhs W_e (+ scale * (lhs m_i A_e) B_e), each row with its own expert's matrices
        y = weight_mm(lhs, w, sizes_E)
        if not adapters:
            return y
        u = _ragged_mm(_dropped(lhs, masks, i), adapters[2 * i], sizes_E)
        return y + lora_scale * _ragged_mm(u, adapters[2 * i + 1], sizes_E)

    return proj(_swiglu(proj(x_MxD, w1_ExDxF, 0), proj(x_MxD, w3_ExDxF, 1)), w2_ExFxD, 2)


def _tiled_mlp(x_MxD, rows: SortedRows, w1_ExDxF, w3_ExDxF, w2_ExFxD, max_tile: int, layer=None, adapters=(),
               lora_scale: float = 1.0, masks=()):
    """Rows padded per expert to a multiple of the tile t, each tile through its expert's SwiGLU
    (weights [E, ...], or a layer stack [L, E, ...] read in place at `layer`).

    Sorted rows whose expert is E (the expert-parallel receive side's padding) belong to no expert:
    they are in no tile and their outputs are zero. Tiles past the last expert's rows are skipped
    at run time, so the work is sum_e ceil(size_e / t) tiles, not the static bound.
    """
    m, num_experts = x_MxD.shape[0], rows.group_sizes_E.shape[0]
    slot_M = capacity.slots(rows.expert_M, rows.group_sizes_E)
    return _rows_in_tiles(x_MxD, rows.expert_M, slot_M, rows.expert_M < num_experts, rows.group_sizes_E,
                          tile_rows(m, num_experts, max_tile), m, (w1_ExDxF, w3_ExDxF, w2_ExFxD), layer, adapters,
                          lora_scale, masks)


def _tile_layout(expert_M, slot_M, in_tiles_M, sizes_E, t: int, num_tiles: int):
    """Where the rows with `in_tiles_M` (row slot_M of expert expert_M's sizes_E[e] rows) go when each
    expert's rows are padded to a multiple of t: (pos_M, their row of the [num_tiles * t] buffer,
    num_tiles * t for the other rows; tile_expert_J; num_active, the tiles holding rows, a prefix).
    The caller bounds sum_e ceil(sizes_E[e] / t) <= num_tiles."""
    num_experts = sizes_E.shape[0]
    padded_E = (sizes_E + t - 1) // t * t
    padded_end_E = jnp.cumsum(padded_E)
    expert_M = jnp.minimum(expert_M, num_experts - 1)
    pos_M = jnp.where(in_tiles_M, padded_end_E[expert_M] - padded_E[expert_M] + slot_M, num_tiles * t)
    first_row_J = jnp.arange(num_tiles) * t
    tile_expert_J = jnp.minimum(jnp.searchsorted(padded_end_E, first_row_J, side="right"), num_experts - 1)
    return pos_M, tile_expert_J.astype(jnp.int32), (padded_end_E[-1] // t).astype(jnp.int32)


def _rows_in_tiles(x_MxD, expert_M, slot_M, in_tiles_M, sizes_E, t: int, max_rows: int, weights, layer=None,
                   adapters=(), lora_scale: float = 1.0, masks=()):
    """The rows with `in_tiles_M` through the tile loop (`_tile_layout`); zero for the other rows.
    `max_rows`: a static bound on sum(sizes_E). [M, D]."""
    (m, d), num_experts = x_MxD.shape, sizes_E.shape[0]
    num_tiles = -(-max_rows // t) + min(num_experts, max_rows)  # bound on sum_e ceil(size_e / t)
    pos_M, tile_expert_J, num_active = _tile_layout(expert_M, slot_M, in_tiles_M, sizes_E, t, num_tiles)

    def tiles(v_MxA):  # rows -> [J, t, A], each row in its tile slot (a mask travels with its row)
        return jnp.zeros((num_tiles * t, v_MxA.shape[1]), v_MxA.dtype).at[pos_M].set(v_MxA, mode="drop").reshape(
            num_tiles, t, -1)

    y_JxtxD = tile_loop_swiglu(tiles(x_MxD), tile_expert_J, num_active, *weights, layer,
                               tuple(adapters), lora_scale, tuple(tiles(m) for m in masks))
    return y_JxtxD.reshape(num_tiles * t, d).at[pos_M].get(mode="fill", fill_value=0)


def _capacity_routed(x_NxD, experts_NxK, weights_NxK, w1_ExDxF, w3_ExDxF, w2_ExFxD, max_tile: int):
    """`routed_experts` on CPU for a training layer's float experts: each expert's first C (token,
    slot) pairs gathered straight from the tokens into [E, C, D] (`capacity.gather_tokens`), three
    batched matmuls, and the gate-weighted sum gathered back from the buffer
    (`capacity.combine_buffer`): no [M, D] copy of sorted rows, and every D-wide move a gather in
    both passes. Pairs past C go through the tile loop (`_overflow_combined`): dropless, the same
    function as the sorted-row paths. Pairs of expert E (none) contribute nothing."""
    (n, k), num_experts = experts_NxK.shape, w1_ExDxF.shape[0]
    m = n * k
    rows = sort_by_expert(experts_NxK, num_experts)
    c = capacity.rows_per_expert(m, num_experts)
    slot_M = capacity.slots(rows.expert_M, rows.group_sizes_E)
    where = capacity.buffer_map(rows.order_M, rows.expert_M, slot_M, n, k, c, num_experts)
    x_ExCxD = capacity.gather_tokens(x_NxD, where).reshape(num_experts, c, -1)
    y_ExCxD = capacity.expert_swiglu(x_ExCxD, w1_ExDxF, w3_ExDxF, w2_ExFxD, _swiglu)
    out_NxD = capacity.combine_buffer(y_ExCxD.reshape(num_experts * c, -1), weights_NxK, where, x_NxD.dtype)
    if m <= c:  # every pair fits the batched part
        return out_NxD
    t = overflow_tile_rows(m, num_experts, max_tile)
    overflow_E = jnp.maximum(rows.group_sizes_E - c, 0)
    routing = (rows, slot_M - c, (slot_M >= c) & (rows.expert_M < num_experts), overflow_E)
    sizes = overflow_buffer_rows(m, c, num_experts, t)
    return out_NxD + _overflow_combined(x_NxD, weights_NxK, w1_ExDxF, w3_ExDxF, w2_ExFxD, routing, t, sizes)


def overflow_buffer_rows(num_pairs: int, capacity_rows: int, num_experts: int, t: int) -> tuple[int, int]:
    """Rows of the overflow tile buffer (each expert's pairs past C padded to a multiple of t), static:
    (usual, worst). Usual: an eighth of the pairs plus a tile per expert (the bench variants' steps
    put at most ~4% of the pairs past C); worst: every pair but C past it."""
    over = num_pairs - capacity_rows
    worst = t * (-(-over // t) + min(num_experts, over))
    return min(t * (-(-(num_pairs // 8) // t) + num_experts), worst), worst


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _overflow_combined(x_NxD, weights_NxK, w1_ExDxF, w3_ExDxF, w2_ExFxD, routing, t: int, buffer_rows):
    """The gate-weighted outputs [N, D] of the pairs past each expert's C (`routing` = sorted rows,
    slot past C, in_tiles_M, overflow_E) through the tile loop, in a buffer of the usual size
    (`overflow_buffer_rows`) where they fit, else of the worst case's; skipped where no expert passes
    C (a `lax.switch` of the three). Every move is a gather or an [N, D]-sized scatter, never one
    of all M pairs. Saves only its inputs; the backward recomputes the taken case's forward, so no
    residual is sized for the worst case."""
    return _overflow_combined_fwd(x_NxD, weights_NxK, w1_ExDxF, w3_ExDxF, w2_ExFxD, routing, t, buffer_rows)[0]


def _overflow_pairs(routing, t: int, size: int, x_NxD, weights_NxK, *weights):
    rows, slot_M, in_tiles_M, overflow_E = routing
    (n, k), d = weights_NxK.shape, x_NxD.shape[1]
    pos_M, tile_expert_J, num_active = _tile_layout(rows.expert_M, slot_M, in_tiles_M, overflow_E, t, size // t)
    token_R, pair_R = capacity.row_owners(pos_M, rows.order_M, size, n, k)
    x_JxtxD = x_NxD.at[token_R].get(mode="fill", fill_value=0).reshape(size // t, t, d)
    y_RxD = tile_loop_swiglu(x_JxtxD, tile_expert_J, num_active, *weights).reshape(size, d)
    w_R = weights_NxK.reshape(-1).at[pair_R].get(mode="fill", fill_value=0)
    y_RxD = y_RxD.astype(jnp.float32) * w_R[:, None].astype(jnp.float32)
    return jnp.zeros((n, d), jnp.float32).at[token_R].add(y_RxD, mode="drop").astype(x_NxD.dtype)


def _overflow_case(routing, t: int, buffer_rows) -> jax.Array:
    """0: no pair past C; 1: they fit the usual buffer; 2: the worst case's."""
    padded_rows = jnp.sum((routing[3] + t - 1) // t * t)
    return jnp.where(padded_rows == 0, 0, jnp.where(padded_rows <= buffer_rows[0], 1, 2))


def _overflow_combined_fwd(x_NxD, weights_NxK, w1_ExDxF, w3_ExDxF, w2_ExFxD, routing, t, buffer_rows):
    args = (x_NxD, weights_NxK, w1_ExDxF, w3_ExDxF, w2_ExFxD)
    branches = [lambda *a: jnp.zeros_like(x_NxD)]
    branches += [functools.partial(_overflow_pairs, routing, t, size) for size in dict.fromkeys(buffer_rows)]
    return jax.lax.switch(_overflow_case(routing, t, buffer_rows), branches, *args), (args, routing)


def _overflow_combined_bwd(t, buffer_rows, res, dy_NxD):
    args, routing = res

    def grads(size):
        return lambda *primals: jax.vjp(functools.partial(_overflow_pairs, routing, t, size), *primals)[1](dy_NxD)

    branches = [lambda *a: tuple(map(jnp.zeros_like, a))] + [grads(size) for size in dict.fromkeys(buffer_rows)]
    return *jax.lax.switch(_overflow_case(routing, t, buffer_rows), branches, *args), None


_overflow_combined.defvjp(_overflow_combined_fwd, _overflow_combined_bwd)


def _at(w_ExAxB, e, layer=None):
    """Expert e's [A, B] of w [E, A, B], or of a stack [L, E, A, B] at `layer`: one slice read."""
    if isinstance(w_ExAxB, QArray):  # its q and scale sliced alike; dequantised by the tile's matmul
        return w_ExAxB[e] if layer is None else w_ExAxB[layer, e]
    if layer is None:
        return jax.lax.dynamic_index_in_dim(w_ExAxB, e, axis=0, keepdims=False)
    return jax.lax.dynamic_slice(w_ExAxB, (layer, e, 0, 0), (1, 1, *w_ExAxB.shape[2:]))[0, 0]


def _add_at(acc_ExAxB, e, value_AxB, layer=None):
    value = (_at(acc_ExAxB, e, layer) + value_AxB)[None]
    if layer is None:
        return jax.lax.dynamic_update_slice(acc_ExAxB, value, (e, 0, 0))
    return jax.lax.dynamic_update_slice(acc_ExAxB, value[None], (layer, e, 0, 0))


def _mm(eq, a, b):
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def _tile_proj(x_txA, w_AxB, adapter=(), scale: float = 1.0, mask_txA=None):
    """x w (+ scale * (x m a) b for an adapter (a [A, r], b [r, B]), m its dropout multipliers or
    none) in x's dtype, fp32 accumulation."""
    dt = x_txA.dtype
    y = _mm("tA,AB->tB", x_txA, quant.as_dense(w_AxB, dt)).astype(dt)  # a quantized expert: this tile's dequant
    if not adapter:
        return y
    a_Axr, b_rxB = (m.astype(dt) for m in adapter)
    x_txA = x_txA if mask_txA is None else x_txA * mask_txA
    return y + scale * _mm("tr,rB->tB", _mm("tA,Ar->tr", x_txA, a_Axr).astype(dt), b_rxB).astype(dt)


def _tile_swiglu(x_txD, w1_DxF, w3_DxF, w2_FxD, adapters=(), scale: float = 1.0, masks=()):
    """One row tile through one expert's SwiGLU: (y [t, D], gate [t, F], up [t, F]), the unit of
    work of `tile_loop_swiglu` (gate and up are what its backward needs). `adapters`: that expert's
    six LoRA matrices (a1, b1, a3, b3, a2, b2) or none; `masks` the tile's dropout multipliers of
    the three adapters' inputs ([t, D], [t, D], [t, F]) or none."""
    ad = [tuple(adapters[i:i + 2]) for i in (0, 2, 4)] if adapters else [()] * 3
    m = masks or (None,) * 3
    gate, up = _tile_proj(x_txD, w1_DxF, ad[0], scale, m[0]), _tile_proj(x_txD, w3_DxF, ad[1], scale, m[1])
    return _tile_proj(_swiglu(gate, up), w2_FxD, ad[2], scale, m[2]), gate, up


def tile_loop_swiglu(x_JxtxD, tile_expert_J, num_active, w1_ExDxF, w3_ExDxF, w2_ExFxD, layer=None, adapters=(),
                     lora_scale: float = 1.0, masks=()):
    """Tile j's rows through expert tile_expert_J[j]'s SwiGLU, one tile per loop step. [J, t, D].

    Weights are [E, ...] or, with `layer` (int32, maybe traced), a layer stack [L, E, ...] read in
    place (inference over a scanned stack: no per-layer copy of every expert's weights); each tile
    casts its expert's weights to x's dtype.

    Only the first `num_active` tiles (int32, traced) run, forward and backward: the loop's trip
    count is theirs, so the static bound's idle tiles cost nothing (their output is zero). Each step
    reads its expert's weights in place (no [J, D, F] copy of them) and the backward adds each
    tile's weight gradient into its expert's slot of one [E, D, F] buffer, so memory follows the
    rows, not tiles x weights. Expert `adapters` (six [E, ...] arrays, module docstring) are read and
    accumulated the same way; `masks` (three [J, t, ...] arrays or none) multiply their inputs
    (adapter dropout), forward and backward.
    """
    weights = (w1_ExDxF, w3_ExDxF, w2_ExFxD)  # quantized ones are frozen: their cotangent is zero
    return _tile_loop(lora_scale, x_JxtxD, tile_expert_J, num_active, weights, layer, tuple(adapters), tuple(masks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tile_loop(scale, x_JxtxD, tile_expert_J, num_active, weights, layer, adapters, masks):
    return _tile_loop_fwd(scale, x_JxtxD, tile_expert_J, num_active, weights, layer, adapters, masks)[0]


def _put(buffer_JxAxB, j, value_AxB):
    return jax.lax.dynamic_update_index_in_dim(buffer_JxAxB, value_AxB.astype(buffer_JxAxB.dtype), j, axis=0)


def _get(buffer_JxAxB, j):
    return jax.lax.dynamic_index_in_dim(buffer_JxAxB, j, axis=0, keepdims=False)


def _tile_loop_fwd(scale, x_JxtxD, tile_expert_J, num_active, weights, layer, adapters, masks):
    (num_tiles, t, d), f = x_JxtxD.shape, weights[0].shape[-1]

    def tile(j, out):
        e = tile_expert_J[j]
        y, gate, up = _tile_swiglu(_get(x_JxtxD, j), *(_at(w, e, layer) for w in weights),
                                   tuple(_at(a, e) for a in adapters), scale, tuple(_get(m, j) for m in masks))
        return tuple(_put(buf, j, v) for buf, v in zip(out, (y, gate, up)))

    zeros = (jnp.zeros((num_tiles, t, d), x_JxtxD.dtype), *[jnp.zeros((num_tiles, t, f), x_JxtxD.dtype)] * 2)
    y_JxtxD, gate_JxtxF, up_JxtxF = jax.lax.fori_loop(0, num_active, tile, zeros)
    return y_JxtxD, (x_JxtxD, tile_expert_J, num_active, weights, layer, adapters, masks, gate_JxtxF, up_JxtxF)


def _lora_back(lhs_txA, dy_txB, a_Axr, b_rxB, scale):
    """Backward of scale * (lhs a) b: (its part of d lhs [t, A], da [A, r], db [r, B]), fp32."""
    dt = lhs_txA.dtype
    a_Axr, b_rxB = a_Axr.astype(dt), b_rxB.astype(dt)
    u_txr = _mm("tA,Ar->tr", lhs_txA, a_Axr).astype(dt)
    du_txr = scale * _mm("tB,rB->tr", dy_txB, b_rxB)
    return (_mm("tr,Ar->tA", du_txr.astype(dt), a_Axr), _mm("tA,tr->Ar", lhs_txA, du_txr.astype(dt)),
            scale * _mm("tr,tB->rB", u_txr, dy_txB))


def _tile_grads(x, gate, up, dy, w1_DxF, w3_DxF, w2_FxD, adapters=(), scale: float = 1.0, masks=()):
    """One tile's backward: (dx [t, D], (dw1 [D, F], dw3 [D, F], dw2 [F, D]), the six adapter
    gradients or ()), weight gradients in fp32. `masks`: the adapters' input multipliers or none."""
    dt = x.dtype
    w1_DxF, w3_DxF, w2_FxD = (quant.as_dense(w, dt) for w in (w1_DxF, w3_DxF, w2_FxD))
    gate32 = gate.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate32)
    act = (gate32 * sig).astype(dt)  # silu(gate), as the forward rounds it
    h = act * up
    dh = _mm("tD,FD->tF", dy, w2_FxD)
    d_adapters = []
    m1, m3, m2 = masks or (1, 1, 1)
    if adapters:
        dh_lora, da2, db2 = _lora_back(h * m2, dy, adapters[4], adapters[5], scale)
        dh = dh + dh_lora * m2
    dup = (dh * act.astype(jnp.float32)).astype(dt)
    dgate = (dh * up.astype(jnp.float32) * sig * (1 + gate32 * (1 - sig))).astype(dt)
    dx = _mm("tF,DF->tD", dgate, w1_DxF) + _mm("tF,DF->tD", dup, w3_DxF)
    if adapters:
        dx1, da1, db1 = _lora_back(x * m1, dgate, adapters[0], adapters[1], scale)
        dx3, da3, db3 = _lora_back(x * m3, dup, adapters[2], adapters[3], scale)
        dx = dx + dx1 * m1 + dx3 * m3
        d_adapters = [da1, db1, da3, db3, da2, db2]
    dw = (_mm("tD,tF->DF", x, dgate), _mm("tD,tF->DF", x, dup), _mm("tF,tD->FD", h, dy))
    return dx.astype(dt), dw, tuple(d_adapters)


def _tile_loop_bwd(scale, res, dy_JxtxD):
    x_JxtxD, tile_expert_J, num_active, weights, layer, adapters, masks, gate_JxtxF, up_JxtxF = res

    def tile(j, carry):
        dx_JxtxD, dw, da = carry
        e = tile_expert_J[j]
        dx, g_w, g_a = _tile_grads(_get(x_JxtxD, j), _get(gate_JxtxF, j), _get(up_JxtxF, j), _get(dy_JxtxD, j),
                                   *(_at(w, e, layer) for w in weights), tuple(_at(a, e) for a in adapters), scale,
                                   tuple(_get(m, j) for m in masks))
        return (_put(dx_JxtxD, j, dx), tuple(acc if isinstance(w, QArray) else _add_at(acc, e, g, layer)
                                             for acc, g, w in zip(dw, g_w, weights)),
                tuple(_add_at(acc, e, g) for acc, g in zip(da, g_a)))

    zeros = tuple(tuple(jnp.zeros(() if isinstance(w, QArray) else w.shape, jnp.float32) for w in ws)
                  for ws in (weights, adapters))
    dx_JxtxD, dw, da = jax.lax.fori_loop(0, num_active, tile, (jnp.zeros_like(x_JxtxD), *zeros))
    return (dx_JxtxD, None, None, tuple(_frozen_cotangent(w) if isinstance(w, QArray) else g.astype(w.dtype)
                                        for g, w in zip(dw, weights)), None,
            tuple(g.astype(a.dtype) for g, a in zip(da, adapters)), tuple(jnp.zeros_like(m) for m in masks))


def _frozen_cotangent(qa: QArray) -> QArray:
    """The zero cotangent of a quantized (frozen) weight: float0 for its integer leaves."""
    return jax.tree.map(lambda v: jnp.zeros_like(v) if jnp.issubdtype(v.dtype, jnp.floating)
                        else np.zeros(v.shape, jax.dtypes.float0), qa)


_tile_loop.defvjp(_tile_loop_fwd, _tile_loop_bwd)


def _fp8_mm(lhs_MxK, rhs, sizes_E):
    """The FP8 block-scaled grouped kernel: stored FP8 experts [E, N, K] with their blocks (no
    requantisation, no bf16 copy; frozen, Dgrad only), or weights quantised per step (training)."""
    from dsv3_jax.ops.linear import fp8_grouped_matmul, fp8_grouped_matmul_stored

    if isinstance(rhs, QArray):
        return fp8_grouped_matmul_stored(lhs_MxK, rhs.q, rhs.scale, sizes_E, lhs_MxK.dtype)
    return fp8_grouped_matmul(lhs_MxK, rhs, sizes_E, lhs_MxK.dtype)


def _kernel_quantized(lhs_MxK, w: QArray, sizes_E):
    """An int8/int4 expert stack through the Pallas grouped kernel that dequantises one weight tile
    at a time (pallas_kernels/quant_grouped_matmul.py): the tiled path's numerics. Differentiable in
    lhs (QLoRA): its backward gives dx through the dequantised tiles and the frozen weights nothing."""
    from pallas_kernels.quant_grouped_matmul import quant_grouped_matmul

    return quant_grouped_matmul(lhs_MxK, w.q, w.scale, sizes_E, fmt=w.fmt, group=w.group, out_dtype=lhs_MxK.dtype)


def kernel_ready(weights) -> bool:
    """Whether int-quantized experts fit the Pallas kernel (groups of a multiple of 32 rows)."""
    return all(isinstance(w, QArray) and w.fmt in ("int8", "int4") and w.group % 32 == 0 for w in weights)


def _dense_mlp(x_MxD, rows: SortedRows, w1_ExDxF, w3_ExDxF, w2_ExFxD, *adapters, lora_scale: float = 1.0,
               masks=()):
    def mm(eq, lhs, w):  # the reference: a quantized stack is dequantised whole
        return jnp.einsum(eq, lhs, quant.as_dense(w, lhs.dtype), preferred_element_type=jnp.float32).astype(lhs.dtype)

    def proj(eqs, lhs, w, i):  # every row through every expert's W (+ scale * (lhs m_i A) B)
        y = mm(eqs[0], lhs, w)
        if not adapters:
            return y
        dropped = lhs if not masks else lhs * (masks[i] if lhs.ndim == 2 else masks[i][:, None])
        return y + lora_scale * mm(eqs[2], mm(eqs[1], dropped, adapters[2 * i]), adapters[2 * i + 1])

    up_eqs = ("MD,EDF->MEF", "MD,EDr->MEr", "MEr,ErF->MEF")
    h_MxExF = _swiglu(proj(up_eqs, x_MxD, w1_ExDxF, 0), proj(up_eqs, x_MxD, w3_ExDxF, 1))
    y_MxExD = proj(("MEF,EFD->MED", "MEF,EFr->MEr", "MEr,ErD->MED"), h_MxExF, w2_ExFxD, 2)
    return jnp.take_along_axis(y_MxExD, rows.expert_M[:, None, None], axis=1)[:, 0]


def _dropped(lhs_MxA, masks, i):
    return lhs_MxA if not masks else lhs_MxA * masks[i]


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


def layer_weights(stacks, layer, dtype):
    """(w1, w3, w2) of one layer in `dtype`, sliced at `layer` from stacks [L, E, ...]."""
    return tuple(w[layer].astype(dtype) for w in stacks)


def _impl_for(weights, impl: str) -> str:
    """Quantized experts choose their kernel: stored FP8 runs the block-scaled grouped kernel
    (unless the dense reference or the tile loop is asked for); int weights run the int paths, with
    `auto` the Pallas kernel off CPU where their groups fit it (`kernel_ready`)."""
    fmt = next((w.fmt for w in weights if isinstance(w, QArray)), None)
    if fmt == "fp8" and impl not in ("dense", "tiled"):
        return "fp8"
    if fmt in ("int8", "int4") and impl in ("fp8", "auto"):
        return "auto_quantized" if kernel_ready(weights) else "auto"
    if impl == "pallas" and not kernel_ready(weights):
        raise ValueError("impl='pallas' runs int8/int4 experts whose quantization group is a multiple of 32")
    return impl


def _check_adapters(adapters):
    if len(adapters) not in (0, 6):
        raise ValueError(f"expert adapters are six arrays (a1, b1, a3, b3, a2, b2), got {len(adapters)}")


def grouped_expert_mlp(x_MxD: jax.Array, rows: SortedRows, w1_ExDxF: jax.Array, w3_ExDxF: jax.Array,
                       w2_ExFxD: jax.Array, *adapters: jax.Array, impl: str = "auto", max_tile: int = 128,
                       layer=None, lora_scale: float = 1.0, lora_dropout=None) -> jax.Array:
    """SwiGLU of each sorted row through its expert: w2(silu(x w1) * x w3). Returns [M, D].

    Weights are [E, ...], or layer stacks [L, E, ...] with `layer`: the tiled path reads those in
    place, the others slice the layer first. `adapters`: none, or six expert LoRA arrays [E, ...]
    with `lora_scale` (module docstring); `lora_dropout` (rate, three keys) drops their inputs per
    sorted row (`adapter_masks`). `auto` picks ragged_dot where the platform runs it
    sparsely and on CPU the tile loop (`routed_experts` takes a training layer's float experts through
    the capacity path before this), for the platform the program is lowered for (a TPU lowering on a
    CPU host gets ragged_dot)."""
    stacked = (w1_ExDxF, w3_ExDxF, w2_ExFxD)
    impl = _impl_for(stacked, impl)
    _check_adapters(adapters)
    masks = adapter_masks(lora_dropout if adapters else None, *x_MxD.shape, stacked[0].shape[-1], x_MxD.dtype)
    lora = {"lora_scale": lora_scale, "masks": masks} if adapters else {}

    def tiled():
        return _tiled_mlp(x_MxD, rows, *stacked, max_tile, layer, adapters, lora_scale, masks)

    def one_layer():
        return (stacked if layer is None else layer_weights(stacked, layer, x_MxD.dtype)) + adapters

    def ragged():
        return _ragged_mlp(x_MxD, rows.group_sizes_E, *one_layer(), **lora)

    def pallas():
        return _ragged_mlp(x_MxD, rows.group_sizes_E, *one_layer(), weight_mm=_kernel_quantized, **lora)

    if impl == "auto":
        return jax.lax.platform_dependent(cpu=tiled, default=ragged)
    if impl == "auto_quantized":
        return jax.lax.platform_dependent(cpu=tiled, default=pallas)
    if impl == "pallas":
        return pallas()
    if impl == "tiled":
        return tiled()
    if impl == "capacity":  # `routed_experts` and `local_expert_mlp` take plain float experts there
        raise ValueError("impl='capacity' runs one layer's float experts without adapters; use 'tiled'")
    if impl == "ragged":
        return ragged()
    if impl == "dense":
        return _dense_mlp(x_MxD, rows, *one_layer(), **lora)
    if impl == "fp8":
        return _ragged_mlp(x_MxD, rows.group_sizes_E, *one_layer(), weight_mm=_fp8_mm, **lora)
    raise ValueError(f"unknown moe impl {impl!r}; expected auto, ragged, tiled, capacity, dense, fp8 or pallas")


def routed_experts(x_NxD: jax.Array, experts_NxK: jax.Array, weights_NxK: jax.Array, w1_ExDxF: jax.Array,
                   w3_ExDxF: jax.Array, w2_ExFxD: jax.Array, *adapters: jax.Array, impl: str = "auto",
                   max_tile: int = 128, layer=None, lora_scale: float = 1.0, lora_dropout=None) -> jax.Array:
    """sum_k weights[n, k] * Expert_{experts[n, k]}(x[n]), dropless. Returns [N, D] in x's dtype.
    Weights and adapters as in `grouped_expert_mlp` (a layer stack with `layer`)."""
    def sorted_rows():
        rows = sort_by_expert(experts_NxK, w1_ExDxF.shape[-3])
        y_MxD = grouped_expert_mlp(x_NxD[rows.token_M], rows, w1_ExDxF, w3_ExDxF, w2_ExFxD, *adapters,
                                   impl=impl, max_tile=max_tile, layer=layer, lora_scale=lora_scale,
                                   lora_dropout=lora_dropout)
        return combine(jnp.zeros_like(y_MxD).at[rows.order_M].set(y_MxD), weights_NxK, x_NxD.dtype)

    def batched():
        return _capacity_routed(x_NxD, experts_NxK, weights_NxK, w1_ExDxF, w3_ExDxF, w2_ExFxD, max_tile)

    plain = layer is None and not adapters and not any(isinstance(w, QArray) for w in (w1_ExDxF, w3_ExDxF, w2_ExFxD))
    if plain and impl == "capacity":
        return batched()
    if plain and impl == "auto":
        return jax.lax.platform_dependent(cpu=batched, default=sorted_rows)
    return sorted_rows()


def local_expert_mlp(x_RxD: jax.Array, expert_R: jax.Array, valid_R: jax.Array, w1_ExDxF: jax.Array,
                     w3_ExDxF: jax.Array, w2_ExFxD: jax.Array, *adapters: jax.Array, impl: str = "auto",
                     max_tile: int = 128, lora_scale: float = 1.0) -> jax.Array:
    """Expert-parallel receive side: row r through its local expert (one expert per row, K = 1).

    Rows with `valid_R` False are padding from the all-to-all. They sort after every expert's rows
    and belong to no group (excluded from the group sizes), so the grouped matmuls (`ragged_dot`,
    the fp8 kernel, the tile loop) never compute them; their outputs are zero. `auto`
    follows the platform the program is lowered for: the tiled loop on CPU, `ragged_dot` elsewhere.
    `adapters`: the local experts' LoRA arrays, as in `grouped_expert_mlp`.
    """
    impl = _impl_for((w1_ExDxF, w3_ExDxF, w2_ExFxD), impl)
    _check_adapters(adapters)
    e = w1_ExDxF.shape[0]
    rows = sort_by_expert(jnp.where(valid_R, expert_R, e)[:, None], e)  # padding: expert e, no group
    x_MxD = x_RxD[rows.token_M]
    weights = (w1_ExDxF, w3_ExDxF, w2_ExFxD)
    lora = {"lora_scale": lora_scale} if adapters else {}

    def tiled():
        return _tiled_mlp(x_MxD, rows, *weights, max_tile, None, adapters, lora_scale)

    def ragged():
        return _ragged_mlp(x_MxD, rows.group_sizes_E, *weights, *adapters, **lora)

    def pallas():
        return _ragged_mlp(x_MxD, rows.group_sizes_E, *weights, *adapters, weight_mm=_kernel_quantized, **lora)

    if impl == "auto":
        y_MxD = jax.lax.platform_dependent(cpu=tiled, default=ragged)
    elif impl == "auto_quantized":
        y_MxD = jax.lax.platform_dependent(cpu=tiled, default=pallas)
    elif impl == "pallas":
        y_MxD = pallas()
    elif impl == "tiled":
        y_MxD = tiled()
    elif impl == "ragged":
        y_MxD = ragged()
    elif impl == "fp8":
        y_MxD = _ragged_mlp(x_MxD, rows.group_sizes_E, *weights, *adapters, weight_mm=_fp8_mm, **lora)
    elif impl == "capacity" and not adapters:  # one expert a row, gate weight 1; padding: expert e, none
        ones = jnp.ones((x_RxD.shape[0], 1), x_RxD.dtype)
        y_RxD = _capacity_routed(x_RxD, jnp.where(valid_R, expert_R, e)[:, None], ones, *weights, max_tile)
        return jnp.where(valid_R[:, None], y_RxD, 0)
    else:  # the dense reference computes every row, padding included (clamped to a real expert)
        clamped = rows._replace(expert_M=jnp.minimum(rows.expert_M, e - 1))
        y_MxD = grouped_expert_mlp(x_MxD, clamped, *weights, *adapters, impl=impl, max_tile=max_tile,
                                   lora_scale=lora_scale)
    y_RxD = jnp.zeros_like(y_MxD).at[rows.order_M].set(y_MxD)
    return jnp.where(valid_R[:, None], y_RxD, 0)

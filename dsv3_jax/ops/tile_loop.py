"""The tile loop: rows sorted by expert, padded per expert to a multiple of a tile of t rows, each
tile through its expert's SwiGLU with the weights read in place, forward and backward.

Letters: M sorted rows, E experts, D model, F expert hidden, J row tiles, t rows per tile, r rank.

Cost ~ (M + E*t) rows: only the tiles holding rows run (the loop's trip count is traced), each
step reads its expert's weights in place and the backward adds each tile's weight gradient into
its expert's slot of one [E, D, F] buffer, so compute and memory follow the routed rows, not the
experts. Expert LoRA adapters (six [E, ...] arrays: a1 [E, D, r], b1 [E, r, F], a3, b3, a2
[E, F, r], b2 [E, r, D]) are read and accumulated the same way; a quantized expert (`QArray`) is
dequantised one tile's expert at a time and, frozen, gets a zero cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.ops import quant
from dsv3_jax.ops.quant import QArray


def tile_rows(num_rows: int, num_experts: int, max_tile: int) -> int:
    """Largest power of two <= max_tile with num_experts * tile <= num_rows (at least 8)."""
    tile = 8
    while tile * 2 <= max_tile and num_experts * tile * 2 <= num_rows:
        tile *= 2
    return tile


def swiglu(gate, up):
    """silu(gate) * up in up's dtype, the silu in fp32: the expert SwiGLU's elementwise step."""
    return jax.nn.silu(gate.astype(jnp.float32)).astype(up.dtype) * up


def expert_and_slot(sizes_E: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(expert_M, slot_M) of M rows sorted by expert with `sizes_E` rows each: each row's expert (E
    for the rows past sum(sizes_E), which belong to no expert) and its rank within its expert."""
    end_E = jnp.cumsum(sizes_E)
    expert_M = jnp.searchsorted(end_E, jnp.arange(m), side="right").astype(jnp.int32)
    start_M = (end_E - sizes_E)[jnp.minimum(expert_M, sizes_E.shape[0] - 1)]
    return expert_M, jnp.arange(m, dtype=jnp.int32) - start_M.astype(jnp.int32)


def tiled_mlp(x_MxD, sizes_E, weights, max_tile: int, layer=None, adapters=(), lora_scale: float = 1.0, masks=()):
    """Every sorted row through its expert in the tile loop; rows past sum(sizes_E) give zero. [M, D]."""
    m, num_experts = x_MxD.shape[0], sizes_E.shape[0]
    expert_M, slot_M = expert_and_slot(sizes_E, m)
    return rows_in_tiles(x_MxD, expert_M, slot_M, expert_M < num_experts, sizes_E,
                         tile_rows(m, num_experts, max_tile), m, weights, layer, adapters, lora_scale, masks)


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


def rows_in_tiles(x_MxD, expert_M, slot_M, in_tiles_M, sizes_E, t: int, max_rows: int, weights, layer=None,
                   adapters=(), lora_scale: float = 1.0, masks=()):
    """The rows with `in_tiles_M` through the tile loop (`_tile_layout`); zero for the other rows.
    `max_rows`: a static bound on sum(sizes_E). [M, D]."""
    (m, d), num_experts = x_MxD.shape, sizes_E.shape[0]
    num_tiles = -(-max_rows // t) + min(num_experts, max_rows)  # bound on sum_e ceil(size_e / t)
    pos_M, tile_expert_J, num_active = _tile_layout(expert_M, slot_M, in_tiles_M, sizes_E, t, num_tiles)

    def tiles(v_MxA):  # rows -> [J, t, A], each row in its tile slot (a mask travels with its row)
        return jnp.zeros((num_tiles * t, v_MxA.shape[1]), v_MxA.dtype).at[pos_M].set(v_MxA, mode="drop").reshape(
            num_tiles, t, -1)

    y_JxtxD = tile_loop_swiglu(lora_scale, tiles(x_MxD), tile_expert_J, num_active, tuple(weights), layer,
                               tuple(adapters), tuple(tiles(m) for m in masks))
    return y_JxtxD.reshape(num_tiles * t, d).at[pos_M].get(mode="fill", fill_value=0)


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
    return _tile_proj(swiglu(gate, up), w2_FxD, ad[2], scale, m[2]), gate, up


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def tile_loop_swiglu(lora_scale: float, x_JxtxD, tile_expert_J, num_active, weights, layer, adapters, masks):
    """Tile j's rows through expert tile_expert_J[j]'s SwiGLU, one tile per loop step. [J, t, D].

    `weights` (w1 [E, D, F], w3 [E, D, F], w2 [E, F, D]; quantized ones are frozen: their cotangent
    is zero) are [E, ...] or, with `layer` (int32, maybe traced), a layer stack [L, E, ...] read in
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
    return _tile_loop_fwd(lora_scale, x_JxtxD, tile_expert_J, num_active, weights, layer, adapters, masks)[0]


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


tile_loop_swiglu.defvjp(_tile_loop_fwd, _tile_loop_bwd)

"""Dropless expert dispatch: sort (token, slot) rows by expert, grouped SwiGLU, combine.

Letters: N tokens, K experts per token, M = N*K sorted rows, E experts, D model, F expert hidden,
J row tiles, t rows per tile.

Three grouped-matmul implementations compute the same function:
- `ragged`: `jax.lax.ragged_dot`, sparse on TPU/GPU. XLA:CPU computes it as if every row met every
  expert (docs/numerics.md, Backend facts), so it is not used on CPU by default.
- `tiled`: rows padded per expert to a multiple of a tile, each tile gathers its expert's weights,
  one batched einsum. Cost ~ (M + E*t) rows; `t` is chosen so that E*t <= M, so the cost follows
  the activated experts, not the total.
- `dense`: every row through every expert, then select. The readable reference, O(E) cost.
- `fp8`: the FP8 block-scaled grouped kernel (`ModelConfig.fp8_matmul`), straight-through backward.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


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


def resolve_impl(impl: str) -> str:
    """`auto` picks ragged_dot where the backend runs it sparsely and the tiled path on CPU."""
    if impl != "auto":
        return impl
    return "tiled" if jax.default_backend() == "cpu" else "ragged"


def tile_rows(num_rows: int, num_experts: int, max_tile: int) -> int:
    """Largest power of two <= max_tile with num_experts * tile <= num_rows (at least 8)."""
    tile = 8
    while tile * 2 <= max_tile and num_experts * tile * 2 <= num_rows:
        tile *= 2
    return tile


def _swiglu(gate, up):
    return jax.nn.silu(gate.astype(jnp.float32)).astype(up.dtype) * up


def _ragged_mlp(x_MxD, sizes_E, w1_ExDxF, w3_ExDxF, w2_ExFxD):
    def mm(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs, sizes_E, preferred_element_type=jnp.float32).astype(lhs.dtype)

    return mm(_swiglu(mm(x_MxD, w1_ExDxF), mm(x_MxD, w3_ExDxF)), w2_ExFxD)


def _tiled_mlp(x_MxD, rows: SortedRows, w1_ExDxF, w3_ExDxF, w2_ExFxD, max_tile: int):
    m, num_experts = x_MxD.shape[0], rows.group_sizes_E.shape[0]
    t = tile_rows(m, num_experts, max_tile)
    num_tiles = -(-m // t) + min(num_experts, m)  # bound on sum_e ceil(size_e / t)
    padded_E = (rows.group_sizes_E + t - 1) // t * t
    padded_end_E = jnp.cumsum(padded_E)
    start_E = jnp.cumsum(rows.group_sizes_E) - rows.group_sizes_E
    pos_M = padded_end_E[rows.expert_M] - padded_E[rows.expert_M] + jnp.arange(m) - start_E[rows.expert_M]
    tile_expert_J = jnp.searchsorted(padded_end_E, jnp.arange(num_tiles) * t, side="right")
    tile_expert_J = jnp.minimum(tile_expert_J, num_experts - 1)

    x_JxtxD = jnp.zeros((num_tiles * t, x_MxD.shape[1]), x_MxD.dtype).at[pos_M].set(x_MxD)
    x_JxtxD = x_JxtxD.reshape(num_tiles, t, -1)

    def mm(lhs, w):
        return jnp.einsum("JtD,JDF->JtF", lhs, w[tile_expert_J],
                          preferred_element_type=jnp.float32).astype(lhs.dtype)

    y_JxtxD = mm(_swiglu(mm(x_JxtxD, w1_ExDxF), mm(x_JxtxD, w3_ExDxF)), w2_ExFxD)
    return y_JxtxD.reshape(num_tiles * t, -1)[pos_M]


def _fp8_mlp(x_MxD, sizes_E, w1_ExDxF, w3_ExDxF, w2_ExFxD):
    from dsv3_jax.ops.linear import fp8_grouped_matmul

    def mm(lhs, rhs):
        return fp8_grouped_matmul(lhs, rhs, sizes_E, lhs.dtype)

    return mm(_swiglu(mm(x_MxD, w1_ExDxF), mm(x_MxD, w3_ExDxF)), w2_ExFxD)


def _dense_mlp(x_MxD, rows: SortedRows, w1_ExDxF, w3_ExDxF, w2_ExFxD):
    def mm(eq, lhs, w):
        return jnp.einsum(eq, lhs, w, preferred_element_type=jnp.float32).astype(lhs.dtype)

    h_MxExF = _swiglu(mm("MD,EDF->MEF", x_MxD, w1_ExDxF), mm("MD,EDF->MEF", x_MxD, w3_ExDxF))
    y_MxExD = mm("MEF,EFD->MED", h_MxExF, w2_ExFxD)
    return jnp.take_along_axis(y_MxExD, rows.expert_M[:, None, None], axis=1)[:, 0]


def grouped_expert_mlp(x_MxD: jax.Array, rows: SortedRows, w1_ExDxF: jax.Array, w3_ExDxF: jax.Array,
                       w2_ExFxD: jax.Array, *, impl: str = "auto", max_tile: int = 128) -> jax.Array:
    """SwiGLU of each sorted row through its expert: w2(silu(x w1) * x w3). Returns [M, D]."""
    impl = resolve_impl(impl)
    if impl == "ragged":
        return _ragged_mlp(x_MxD, rows.group_sizes_E, w1_ExDxF, w3_ExDxF, w2_ExFxD)
    if impl == "tiled":
        return _tiled_mlp(x_MxD, rows, w1_ExDxF, w3_ExDxF, w2_ExFxD, max_tile)
    if impl == "dense":
        return _dense_mlp(x_MxD, rows, w1_ExDxF, w3_ExDxF, w2_ExFxD)
    if impl == "fp8":
        return _fp8_mlp(x_MxD, rows.group_sizes_E, w1_ExDxF, w3_ExDxF, w2_ExFxD)
    raise ValueError(f"unknown moe impl {impl!r}; expected auto, ragged, tiled, dense or fp8")


def routed_experts(x_NxD: jax.Array, experts_NxK: jax.Array, weights_NxK: jax.Array, w1_ExDxF: jax.Array,
                   w3_ExDxF: jax.Array, w2_ExFxD: jax.Array, *, impl: str = "auto",
                   max_tile: int = 128) -> jax.Array:
    """sum_k weights[n, k] * Expert_{experts[n, k]}(x[n]), dropless. Returns [N, D] in x's dtype."""
    n, k = experts_NxK.shape
    rows = sort_by_expert(experts_NxK, w1_ExDxF.shape[0])
    y_MxD = grouped_expert_mlp(x_NxD[rows.token_M], rows, w1_ExDxF, w3_ExDxF, w2_ExFxD,
                               impl=impl, max_tile=max_tile)
    unsorted_NxKxD = jnp.zeros_like(y_MxD).at[rows.order_M].set(y_MxD).reshape(n, k, -1)
    out = jnp.einsum("NKD,NK->ND", unsorted_NxKxD, weights_NxK.astype(y_MxD.dtype),
                     preferred_element_type=jnp.float32)
    return out.astype(x_NxD.dtype)


def local_expert_mlp(x_RxD: jax.Array, expert_R: jax.Array, valid_R: jax.Array, w1_ExDxF: jax.Array,
                     w3_ExDxF: jax.Array, w2_ExFxD: jax.Array, *, impl: str = "auto",
                     max_tile: int = 128) -> jax.Array:
    """Expert-parallel receive side: row r through its local expert (one expert per row, K = 1).

    Rows with `valid_R` False are padding from the all-to-all; their outputs are zero.
    """
    rows = sort_by_expert(expert_R[:, None], w1_ExDxF.shape[0])
    y_MxD = grouped_expert_mlp(x_RxD[rows.token_M], rows, w1_ExDxF, w3_ExDxF, w2_ExFxD, impl=impl,
                               max_tile=max_tile)
    y_RxD = jnp.zeros_like(y_MxD).at[rows.order_M].set(y_MxD)
    return jnp.where(valid_R[:, None], y_RxD, 0)

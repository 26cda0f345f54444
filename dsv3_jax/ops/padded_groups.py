"""Padded groups: the CPU path of a training layer's float experts without adapters.

Each expert's first C sorted rows are gathered into one [E, C, D] buffer and go through the
SwiGLU as three batched matmuls over all experts at once; their outputs are gathered back to the
rows. The rows past an expert's C go through the tile loop (`tile_loop.rows_in_tiles`), so the
whole stays dropless: the same function as every other path. C is `HEADROOM` x the mean rows per
expert, so with a balanced router every row, or almost every, is in the batched part, whose
padding is at most E * C ~ 1.25 M rows.

Why: XLA:CPU runs one [E, C, D] x [E, D, F] batched dot faster than the same FLOPs as a loop of
[t, D] x [D, F] tiles, whose slices and updates add their own cost (docs/benchmarks.md, Kernel
choices).

Not to be confused with `expert_capacity_factor` (sharding/expert_parallel.py), which drops the
rows past a device's capacity: nothing is dropped here.

Letters: M sorted rows, E experts, C rows per expert in the buffer, D model, F expert hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.ops import tile_loop

HEADROOM = 1.25  # C over the mean rows per expert


def rows_per_expert(num_rows: int, num_experts: int) -> int:
    """C: HEADROOM x the mean rows per expert, rounded up to a multiple of 8 (at least 8)."""
    return max(8, (-(-int(HEADROOM * num_rows) // num_experts) + 7) // 8 * 8)


def overflow_tile_rows(num_rows: int, num_experts: int, max_tile: int) -> int:
    """Rows per tile for the rows past C: the power of two at or above sqrt(num_rows / num_experts),
    in [8, max_tile] (such remainders are a few rows per expert)."""
    return min(max_tile, max(8, 1 << max(0, int(np.ceil(np.log2(np.sqrt(num_rows / num_experts)))))))


def expert_swiglu(x_ExCxD, w1_ExDxF, w3_ExDxF, w2_ExFxD) -> jax.Array:
    """Each expert's C rows through its SwiGLU: three batched matmuls, fp32 accumulation. [E, C, D]."""
    def mm(eq, a, b):
        return jnp.einsum(eq, a, b.astype(a.dtype), preferred_element_type=jnp.float32).astype(a.dtype)

    h_ExCxF = tile_loop.swiglu(mm("ECD,EDF->ECF", x_ExCxD, w1_ExDxF), mm("ECD,EDF->ECF", x_ExCxD, w3_ExDxF))
    return mm("ECF,EFD->ECD", h_ExCxF, w2_ExFxD)


def padded_groups_mlp(x_MxD: jax.Array, sizes_E: jax.Array, weights, max_tile: int) -> jax.Array:
    """Each sorted row through its expert (module docstring): [M, D], zero for rows of no expert."""
    (m, d), num_experts = x_MxD.shape, sizes_E.shape[0]
    c = rows_per_expert(m, num_experts)
    expert_M, slot_M = tile_loop.expert_and_slot(sizes_E, m)
    start_E = jnp.cumsum(sizes_E) - sizes_E
    slot_C = jnp.arange(c, dtype=jnp.int32)
    row_ExC = jnp.where(slot_C < sizes_E[:, None], start_E[:, None] + slot_C, m)  # m: an empty slot
    y_ExCxD = expert_swiglu(x_MxD.at[row_ExC].get(mode="fill", fill_value=0), *weights)
    in_buffer_M = (slot_M < c) & (expert_M < num_experts)
    y_MxD = y_ExCxD.reshape(num_experts * c, d).at[jnp.where(in_buffer_M, expert_M * c + slot_M, num_experts * c)].get(
        mode="fill", fill_value=0)
    if m <= c:  # every row fits the buffer
        return y_MxD
    overflow_E = jnp.maximum(sizes_E - c, 0)
    y_past_MxD = tile_loop.rows_in_tiles(x_MxD, expert_M, slot_M - c, ~in_buffer_M & (expert_M < num_experts),
                                         overflow_E, overflow_tile_rows(m, num_experts, max_tile), m - c, weights)
    return jnp.where(in_buffer_M[:, None], y_MxD, y_past_MxD)

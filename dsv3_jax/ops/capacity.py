"""The batched part of the CPU training path of the routed experts (`dispatch`'s `capacity`).

Each expert's first C sorted rows go into one [E, C, D] buffer and through the SwiGLU as three
batched matmuls over all experts at once; rows past an expert's C (the overflow) are left to the
tile loop (`dispatch.tile_loop_swiglu`), so the whole stays dropless. C is the mean rows per expert
(M / E, rounded up to a multiple of 8): with a balanced router almost every row is in the batched
part, whose padding is at most E * C ~ M rows.

Why (docs/benchmarks.md): XLA:CPU runs a [t, D] x [D, F] matmul of one tile at about half the rate
of the same FLOPs in one [E, C, D] x [E, D, F] batched dot, and the tile loop's slices and updates
cost as much again; at the bench's issue-27 variant a MoE layer's forward and backward took 150 ms
through the tile loop and 109 ms this way (same process, alternating).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rows_per_expert(num_rows: int, num_experts: int) -> int:
    """C: the mean rows per expert, rounded up to a multiple of 8 (at least 8)."""
    return max(8, (-(-num_rows // num_experts) + 7) // 8 * 8)


def slots(expert_M: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    """Each sorted row's rank within its expert's run of rows (rows sorted by expert). Rows of no
    expert (expert == E, sorted last) get ranks past every expert's."""
    start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    clamped_M = jnp.minimum(expert_M, group_sizes_E.shape[0] - 1)
    return jnp.arange(expert_M.shape[0], dtype=jnp.int32) - start_E[clamped_M].astype(jnp.int32)


def batched_swiglu(x_MxD: jax.Array, expert_M: jax.Array, slot_M: jax.Array, in_batch_M: jax.Array, c: int,
                   w1_ExDxF: jax.Array, w3_ExDxF: jax.Array, w2_ExFxD: jax.Array, swiglu) -> jax.Array:
    """The SwiGLU of the rows with `in_batch_M` (slot < C of a real expert), zero for the others:
    rows scattered to [E, C, D], three batched matmuls (fp32 accumulation), gathered back. [M, D]."""
    (m, d), num_experts = x_MxD.shape, w1_ExDxF.shape[0]
    index_M = jnp.where(in_batch_M, expert_M * c + slot_M, num_experts * c)  # out of range: dropped
    x_ExCxD = jnp.zeros((num_experts * c, d), x_MxD.dtype).at[index_M].set(x_MxD, mode="drop").reshape(
        num_experts, c, d)

    def mm(eq, a, b):
        return jnp.einsum(eq, a, b.astype(a.dtype), preferred_element_type=jnp.float32).astype(a.dtype)

    h_ExCxF = swiglu(mm("ECD,EDF->ECF", x_ExCxD, w1_ExDxF), mm("ECD,EDF->ECF", x_ExCxD, w3_ExDxF))
    y_ExCxD = mm("ECF,EFD->ECD", h_ExCxF, w2_ExFxD)
    return y_ExCxD.reshape(num_experts * c, d).at[index_M].get(mode="fill", fill_value=0)

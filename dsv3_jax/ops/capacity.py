"""The batched part of the CPU training path of the routed experts (`dispatch`'s `capacity`).

Each expert's first C sorted rows go into one [E, C, D] buffer and through the SwiGLU as three
batched matmuls over all experts at once; rows past an expert's C (the overflow) are left to the
tile loop (`dispatch.tile_loop_swiglu`), so the whole stays dropless. C is 1.25 x the mean rows per
expert (`rows_per_expert`): with a balanced router every row, or almost every, is in the batched part,
whose padding is at most E * C ~ 1.25 M rows.

Why (docs/benchmarks.md): XLA:CPU runs a [t, D] x [D, F] matmul of one tile at about half the rate
of the same FLOPs in one [E, C, D] x [E, D, F] batched dot, and the tile loop's slices and updates
cost as much again. A MoE layer of the bench's issue-27 variant (2048 tokens, top-4 of 32, D 320,
F 128), forward and backward, same process: tile loop 138 ms, this path 94 ms with C at the mean,
84 ms at 1.25 x the mean (`python -m experiments.bench_moe_dispatch --tokens 2048 --top_k 4 --dim
320 --hidden 128 --experts 32 64 --impls capacity tiled --grad --headroom 1.0 1.125 1.25`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


HEADROOM = 1.25  # C over the mean rows per expert


def rows_per_expert(num_rows: int, num_experts: int) -> int:
    """C: HEADROOM x the mean rows per expert, rounded up to a multiple of 8 (at least 8). With C at
    the mean, the rows past it (~200 of 8192 at the issue-27 variant's random init, whose loads span
    0.86-1.12 x the mean) cost a MoE layer's fwd+bwd 89 ms against 73 ms with none; at 1.25 x the
    mean none are left there (module docstring's figures)."""
    return max(8, (-(-int(HEADROOM * num_rows) // num_experts) + 7) // 8 * 8)


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

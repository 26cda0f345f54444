"""The batched part of the CPU training path of the routed experts (`dispatch`'s `capacity`).

Each expert's first C (token, slot) pairs are gathered straight from the tokens into one
[E, C, D] buffer (`gather_tokens`) and go through the SwiGLU as three batched matmuls over all
experts at once (`expert_swiglu`); the gate-weighted sum is gathered back from the buffer
(`combine_buffer`). Both passes move D-wide rows with gathers only (a pair within C has one buffer
row and a buffer row one pair: `BufferMap`), and no [M, D] copy of sorted rows is made: against
sorted rows scattered into the buffer and back, 1.03-1.07x on the bench's four train-step
variants (docs/benchmarks.md). Pairs past an expert's C (the overflow) are left to the tile loop
(`dispatch._overflow_combined`), so the whole stays dropless. C is 1.25 x the mean rows per expert
(`rows_per_expert`): with a balanced router every pair, or almost every, is in the batched part,
whose padding is at most E * C ~ 1.25 M rows.

Why (docs/benchmarks.md): XLA:CPU runs a [t, D] x [D, F] matmul of one tile at about half the rate
of the same FLOPs in one [E, C, D] x [E, D, F] batched dot, and the tile loop's slices and updates
cost as much again. A MoE layer of the bench's issue-27 variant (2048 tokens, top-4 of 32, D 320,
F 128), forward and backward, same process: tile loop 138 ms, this path 94 ms with C at the mean,
84 ms at 1.25 x the mean (`python -m experiments.bench_moe_dispatch --tokens 2048 --top_k 4 --dim
320 --hidden 128 --experts 32 64 --impls capacity tiled --grad --headroom 1.0 1.125 1.25`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sharding.expert_parallel import combine


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


def expert_swiglu(x_ExCxD, w1_ExDxF, w3_ExDxF, w2_ExFxD, swiglu) -> jax.Array:
    """Each expert's C rows through its SwiGLU: three batched matmuls, fp32 accumulation. [E, C, D]."""
    def mm(eq, a, b):
        return jnp.einsum(eq, a, b.astype(a.dtype), preferred_element_type=jnp.float32).astype(a.dtype)

    h_ExCxF = swiglu(mm("ECD,EDF->ECF", x_ExCxD, w1_ExDxF), mm("ECD,EDF->ECF", x_ExCxD, w3_ExDxF))
    return mm("ECF,EFD->ECD", h_ExCxF, w2_ExFxD)


class BufferMap(NamedTuple):
    """Which (token, slot) pair fills each row of the [E * C] buffer and where each pair went.
    pos_NxK: the pair's buffer row (E * C past its expert's C); token_B, pair_B: the token and the
    flat pair index n * K + k of buffer row b (N and N * K for an unfilled row). One to one between
    filled rows and pairs within C, so both passes move rows with gathers only (no scatter of D-wide
    rows): `gather_tokens` and `combine_buffer`."""
    pos_NxK: jax.Array
    token_B: jax.Array
    pair_B: jax.Array


def buffer_map(order_M, expert_M, slot_M, n: int, k: int, c: int, num_experts: int) -> BufferMap:
    """The map for rows sorted by expert (`order_M`: each sorted row's pair index, `expert_M`,
    `slot_M` its rank within its expert)."""
    in_batch_M = (slot_M < c) & (expert_M < num_experts)
    pos_M = jnp.where(in_batch_M, expert_M * c + slot_M, num_experts * c).astype(jnp.int32)
    pos_P = jnp.zeros((n * k,), jnp.int32).at[order_M].set(pos_M)
    token_B, pair_B = row_owners(pos_M, order_M, num_experts * c, n, k)
    return BufferMap(pos_P.reshape(n, k), token_B, pair_B)


def row_owners(pos_M, order_M, rows: int, n: int, k: int) -> tuple[jax.Array, jax.Array]:
    """(token_B, pair_B) of a buffer of `rows` rows: the token and the (token, slot) pair that
    `pos_M` places in each row (n and n * k, out of range, in rows nothing fills; positions past
    the buffer are dropped)."""
    token_B = jnp.full((rows,), n, jnp.int32).at[pos_M].set(order_M // k, mode="drop")
    pair_B = jnp.full((rows,), n * k, jnp.int32).at[pos_M].set(order_M, mode="drop")
    return token_B, pair_B


@jax.custom_vjp
def gather_tokens(x_NxD: jax.Array, where: BufferMap) -> jax.Array:
    """The buffer [E * C, D]: row b is token token_B[b] (zero if unfilled). Backward: a token's
    gradient is the sum of its K buffer rows, gathered by pos_NxK."""
    return x_NxD.at[where.token_B].get(mode="fill", fill_value=0)


def _gather_tokens_fwd(x_NxD, where):
    return gather_tokens(x_NxD, where), where


def _gather_tokens_bwd(where, d_BxD):
    d_NxKxD = d_BxD.at[where.pos_NxK].get(mode="fill", fill_value=0)
    return jnp.sum(d_NxKxD.astype(jnp.float32), axis=1).astype(d_BxD.dtype), None


gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def combine_buffer(y_BxD: jax.Array, weights_NxK: jax.Array, where: BufferMap, dtype) -> jax.Array:
    """sum_k weights[n, k] * y_B[pos[n, k]] (zero past C) in fp32, returned in `dtype`. [N, D].
    Backward: dy_B[b] = weights[pair_B[b]] * dout[token_B[b]], a gather (the map is one to one)."""
    return _combine_buffer_fwd(y_BxD, weights_NxK, where, dtype)[0]


def _combine_buffer_fwd(y_BxD, weights_NxK, where, dtype):
    y_PxD = y_BxD.at[where.pos_NxK.reshape(-1)].get(mode="fill", fill_value=0)
    return combine(y_PxD, weights_NxK, dtype), (y_BxD, weights_NxK, where)


def _combine_buffer_bwd(dtype, res, dout_NxD):
    y_BxD, weights_NxK, where = res
    y_NxKxD = y_BxD.at[where.pos_NxK].get(mode="fill", fill_value=0)
    d_weights = jnp.einsum("NKD,ND->NK", y_NxKxD, dout_NxD.astype(y_BxD.dtype), preferred_element_type=jnp.float32)
    w_B = weights_NxK.reshape(-1).at[where.pair_B].get(mode="fill", fill_value=0)
    dout_BxD = dout_NxD.at[where.token_B].get(mode="fill", fill_value=0)
    dy_BxD = (dout_BxD.astype(jnp.float32) * w_B[:, None].astype(jnp.float32)).astype(y_BxD.dtype)
    return dy_BxD, d_weights.astype(weights_NxK.dtype), None


combine_buffer.defvjp(_combine_buffer_fwd, _combine_buffer_bwd)

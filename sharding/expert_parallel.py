"""Expert parallelism: tokens travel to their experts' devices and back by all-to-all in shard_map.

Letters: N tokens on this device, K experts per token, M = N*K (token, slot) rows, P devices on
the expert axis, E experts (E/P local to each device), C rows sent to each device, R = P*C rows
received, D model width.

Per device, inside `shard_map` over the whole mesh (tokens split over `token_axes`, expert weights
split on their leading dimension over `expert_axis`):
1. rows are grouped by destination device (expert // (E/P)) and packed into a [P, C, D] buffer;
2. `all_to_all` over the expert axis: row block p goes to device p, which receives [P, C, D];
3. `local_fn` runs the grouped matmul on the local experts over the rows received: padding rows
   belong to no expert (`valid_R` False), so the work summed over devices is the N*K routed rows
   plus tile rounding, not P x that;
4. `all_to_all` back, rows return to their (token, slot) and are combined with the gate weights.

Tensor ranks share the work: a mesh with `tensor` > 1 holds the same tokens on every tensor rank
(activations are split over the batch axes only), so the shard_map splits them over `tensor` too
(`split_axes`) and each tensor rank exchanges and computes its own share; the expert weights come
in with their `mlp` dimension gathered, as FSDP gathers any weight for its layer. Without this each
tensor rank would repeat the same rows: `tensor` x the expert work. Where the tokens cannot be
split (N not divisible by the axes' product, e.g. one decode token), they stay whole on each rank.

Dropless by default: C = M, the worst case (every row of a device choosing one device), so no
token is ever dropped, at the price of a P x M-row receive buffer (memory, not work).
`capacity_factor` cf (`ModelConfig.expert_capacity_factor`) sets C = ceil(cf * M / P): a
P*C = cf*M-row buffer; rows past C are dropped (their contribution is zero), as in GShard, and
counted: `expert_parallel` returns the number of dropped (token, expert) pairs over the mesh. The
only dropping path: ops/padded_groups.py, the CPU path of the single-device dispatch, is dropless.

Two exchanges, same results (`exchange=`):
- "padded": `all_to_all` of the [P, C, D] buffer, padding rows included. Runs on every backend;
  the one XLA:CPU can run.
- "ragged": `jax.lax.ragged_all_to_all` sends each device only its filled rows (sorted by
  destination, sizes from one all_gather of the [P] send counts) into a [P * C, D] buffer, and the
  results come back the same way; traffic follows the routed rows, not the worst case. XLA:CPU
  has no ragged-all-to-all thunk (docs/numerics.md, Backend facts), so a program lowered for CPU runs this path with
  `ragged_all_to_all_by_gather`, an all_gather emulation of the collective's documented
  semantics; the tests check that the real collective lowers for TPU and CUDA.
"auto" (the default) takes "ragged" on TPU and GPU and "padded" on CPU. Every such choice is made
by `jax.lax.platform_dependent`, i.e. for the platform the program is lowered for (a TPU lowering
on a CPU host gets the TPU program), not the host's default backend.

No model knowledge: the caller passes the expert weights and the function that applies them.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# (x_RxD, local_expert_R, valid_R, *local_weights) -> y_RxD; rows with valid_R False are padding
# (local_expert_R -1): belonging to no expert, they must cost no work and give zero.
LocalFn = Callable[..., jax.Array]
EXCHANGES = ("auto", "padded", "ragged")


def is_active(mesh, expert_axis: str = "expert") -> bool:
    """True when `mesh` (e.g. the context mesh inside jit) splits experts over `expert_axis`."""
    return mesh is not None and not mesh.empty and mesh.shape.get(expert_axis, 1) > 1


# Axes whose devices hold different tokens (rules.BATCH_AXES, in its order): `pipeline` too, where
# it is not manual, i.e. outside the pipelined stack (the MTP layer), whose rows are split over it.
TOKEN_AXES = ("data", "fsdp", "expert", "pipeline")
SPLIT_AXES = ("tensor",)  # axes whose devices hold the same tokens: each takes a share of them here


def _axis_size(mesh, axis: str) -> int:
    """`axis`'s size, 1 where the mesh lacks it or it is manual (inside a shard_map over it)."""
    return 1 if axis in getattr(mesh, "manual_axes", ()) else mesh.shape.get(axis, 1)


def splits_tokens(mesh, token_axes: Sequence[str] = TOKEN_AXES) -> bool:
    """True when `mesh` splits tokens over any of `token_axes`."""
    return mesh is not None and not mesh.empty and any(_axis_size(mesh, a) > 1 for a in token_axes)


def shard_axes(mesh, num_tokens: int, token_axes: Sequence[str] = TOKEN_AXES,
               split_axes: Sequence[str] = SPLIT_AXES) -> tuple[str, ...]:
    """Mesh axes the shard_map splits the tokens over: the `token_axes` the mesh has, then each of
    `split_axes` that still divides the tokens (module docstring)."""
    axes = tuple(a for a in token_axes if _axis_size(mesh, a) > 1)
    for a in split_axes:
        if _axis_size(mesh, a) > 1 and num_tokens % math.prod(mesh.shape[b] for b in axes + (a,)) == 0:
            axes += (a,)
    return axes


def token_parallel(x_NxD: jax.Array, experts_NxK: jax.Array, weights_NxK: jax.Array,
                   expert_weights: Sequence[jax.Array], dispatch_fn: Callable[..., jax.Array], *, mesh,
                   token_axes: Sequence[str] = TOKEN_AXES, split_axes: Sequence[str] = SPLIT_AXES) -> jax.Array:
    """`dispatch_fn(x, experts, weights, *expert_weights)` on each device's own tokens, with every
    expert's weights whole (gathered, as FSDP gathers any weight). Without this, XLA's partitioner
    gathers every device's routing to sort it globally, and each device computes the whole batch's
    experts: P x the work on a data- or fsdp-split mesh. Tensor ranks share the tokens out as in
    `expert_parallel`."""
    tokens = P(shard_axes(mesh, x_NxD.shape[0], token_axes, split_axes) or None, None)
    return jax.shard_map(dispatch_fn, mesh=mesh, in_specs=(tokens, tokens, tokens, *(P() for _ in expert_weights)),
                         out_specs=tokens, check_vma=False)(x_NxD, experts_NxK, weights_NxK, *expert_weights)


def capacity(rows: int, num_devices: int, capacity_factor: float | None) -> int:
    """Rows each device sends to each device: all of them (dropless) or cf * rows / P."""
    if capacity_factor is None:
        return rows
    return max(1, min(rows, math.ceil(capacity_factor * rows / num_devices)))


def expert_parallel(x_NxD: jax.Array, experts_NxK: jax.Array, weights_NxK: jax.Array,
                    expert_weights: Sequence[jax.Array], local_fn: LocalFn, *, mesh, num_experts: int,
                    expert_axis: str = "expert", token_axes: Sequence[str] = TOKEN_AXES,
                    split_axes: Sequence[str] = SPLIT_AXES,
                    capacity_factor: float | None = None, exchange: str = "auto",
                    ragged_all_to_all: Callable | None = None) -> tuple[jax.Array, jax.Array]:
    """sum_k weights[n, k] * Expert_{experts[n, k]}(x[n]) with experts split over `expert_axis`.

    x [N, D] (global), experts/weights [N, K]; each of `expert_weights` has experts on dim 0.
    Tokens are split over the mesh's `token_axes` and shared out over `split_axes` (`shard_axes`).
    `exchange`: "auto", "padded" or "ragged" (module docstring); `ragged_all_to_all` replaces the
    collective of the ragged exchange (default: jax.lax.ragged_all_to_all, its all_gather
    emulation on CPU). Returns ([N, D] in x's dtype, int32 [] dropped (token, expert) pairs, 0
    when dropless).
    """
    p = mesh.shape[expert_axis]
    if num_experts % p:
        raise ValueError(f"num_experts={num_experts} is not divisible by mesh axis {expert_axis}={p}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    token_axes = shard_axes(mesh, x_NxD.shape[0], token_axes, split_axes)
    tokens = P(token_axes or None, None)
    weight_specs = tuple(P(expert_axis, *([None] * (w.ndim - 1))) for w in expert_weights)
    exchange_ops = ragged_all_to_all or _ragged_collective
    bodies = {"padded": _local_body(local_fn, p, num_experts // p, expert_axis, capacity_factor, token_axes),
              "ragged": _ragged_body(local_fn, p, num_experts // p, expert_axis, capacity_factor, token_axes,
                                     exchange_ops)}

    def run(name):
        return lambda *args: jax.shard_map(bodies[name], mesh=mesh, in_specs=(tokens, tokens, tokens, *weight_specs),
                                           out_specs=(tokens, P()), check_vma=False)(*args)

    args = (x_NxD, experts_NxK, weights_NxK, *expert_weights)
    if exchange == "auto":
        return jax.lax.platform_dependent(*args, cpu=run("padded"), default=run("ragged"))
    return run(exchange)(*args)


def _ragged_collective(*args, axis_name: str):
    """jax.lax.ragged_all_to_all, or its all_gather emulation in a program lowered for CPU."""
    return jax.lax.platform_dependent(
        *args, cpu=functools.partial(ragged_all_to_all_by_gather, axis_name=axis_name),
        default=functools.partial(jax.lax.ragged_all_to_all, axis_name=axis_name))


def _by_destination(experts_NxK: jax.Array, local_experts: int, p: int):
    """(flat expert ids [M], destination device [M], row order grouping destinations [M], rows per
    destination [P]) for this device's (token, slot) rows."""
    flat = experts_NxK.reshape(-1)
    dest_M = flat // local_experts
    order_M = jnp.argsort(dest_M, stable=True)
    return flat, dest_M, order_M, jnp.zeros((p,), jnp.int32).at[dest_M].add(1)


def combine(y_MxD: jax.Array, weights_NxK: jax.Array, dtype) -> jax.Array:
    """sum_k weights[n, k] * y[n * K + k] in fp32, returned in `dtype`: the gate-weighted sum of a
    token's expert outputs, rows in (token, slot) order. The one combine (ops/dispatch.py uses it)."""
    n, k = weights_NxK.shape
    out = jnp.einsum("NKD,NK->ND", y_MxD.reshape(n, k, -1), weights_NxK.astype(y_MxD.dtype),
                     preferred_element_type=jnp.float32)
    return out.astype(dtype)


def _dropped(counts_P: jax.Array, c: int, token_axes) -> jax.Array:
    """(token, expert) pairs past the capacity, summed over every device holding distinct tokens."""
    mine = jnp.sum(jnp.maximum(counts_P - c, 0)).astype(jnp.int32)
    return jax.lax.psum(mine, token_axes) if token_axes else mine


def _local_body(local_fn: LocalFn, p: int, local_experts: int, expert_axis: str, capacity_factor, token_axes):
    def body(x_NxD, experts_NxK, weights_NxK, *local_weights):
        n, k = experts_NxK.shape
        d = x_NxD.shape[1]
        m = n * k
        c = capacity(m, p, capacity_factor)
        flat, dest_M, order_M, counts_P = _by_destination(experts_NxK, local_experts, p)
        dest_sorted = dest_M[order_M]
        slot_M = jnp.arange(m) - (jnp.cumsum(counts_P) - counts_P)[dest_sorted]
        keep_M = slot_M < c
        slot_M = jnp.where(keep_M, slot_M, c)  # out of bounds: dropped by the scatter below
        send_PxCxD = jnp.zeros((p, c, d), x_NxD.dtype).at[dest_sorted, slot_M].set(
            x_NxD[order_M // k], mode="drop")
        send_e_PxC = jnp.full((p, c), -1, jnp.int32).at[dest_sorted, slot_M].set(
            (flat[order_M] % local_experts).astype(jnp.int32), mode="drop")

        recv_PxCxD = jax.lax.all_to_all(send_PxCxD, expert_axis, 0, 0)
        recv_e_R = jax.lax.all_to_all(send_e_PxC, expert_axis, 0, 0).reshape(-1)
        y_RxD = local_fn(recv_PxCxD.reshape(p * c, d), recv_e_R, recv_e_R >= 0, *local_weights).astype(x_NxD.dtype)

        back_PxCxD = jax.lax.all_to_all(y_RxD.reshape(p, c, d), expert_axis, 0, 0)
        y_sorted_MxD = back_PxCxD.at[dest_sorted, slot_M].get(mode="fill", fill_value=0)
        y_MxD = jnp.zeros((m, d), y_sorted_MxD.dtype).at[order_M].set(y_sorted_MxD)
        return combine(y_MxD, weights_NxK, x_NxD.dtype), _dropped(counts_P, c, token_axes)

    return body


def _ragged_body(local_fn: LocalFn, p: int, local_experts: int, expert_axis: str, capacity_factor, token_axes,
                 ragged_all_to_all: Callable):
    def body(x_NxD, experts_NxK, weights_NxK, *local_weights):
        n, k = experts_NxK.shape
        d = x_NxD.shape[1]
        m = n * k
        c = capacity(m, p, capacity_factor)
        me = jax.lax.axis_index(expert_axis)
        flat, _, order_M, counts_P = _by_destination(experts_NxK, local_experts, p)
        # Everyone's row counts [source, destination], in one collective; sizes and starts follow.
        counts_PxP = jax.lax.all_gather(counts_P, expert_axis)
        starts_PxP = jnp.cumsum(counts_PxP, axis=1) - counts_PxP  # where each destination's rows start, sorted
        sent_PxP = jnp.minimum(counts_PxP, c)  # the first C rows of each group go; the rest are dropped
        starts_P, send_P = starts_PxP[me], sent_PxP[me]
        recv_P = sent_PxP[:, me]  # rows arriving from each source
        recv_start_P = jnp.cumsum(recv_P) - recv_P  # sources in order in the receive buffer
        # Where my rows land on each destination j: after the rows of sources before me.
        land_P = jnp.sum(jnp.where(jnp.arange(p)[:, None] < me, sent_PxP, 0), axis=0)

        rows_MxD = x_NxD[order_M // k]
        local_e_M = (flat[order_M] % local_experts).astype(jnp.int32)
        recv_RxD = ragged_all_to_all(rows_MxD, jnp.zeros((p * c, d), x_NxD.dtype), starts_P, send_P, land_P,
                                     recv_P, axis_name=expert_axis)
        recv_e_R = ragged_all_to_all(local_e_M[:, None], jnp.full((p * c, 1), -1, jnp.int32), starts_P, send_P,
                                     land_P, recv_P, axis_name=expert_axis)[:, 0]
        y_RxD = local_fn(recv_RxD, recv_e_R, recv_e_R >= 0, *local_weights).astype(x_NxD.dtype)

        # Back: the block from source i returns to where source i's rows for me started.
        y_sorted_MxD = ragged_all_to_all(y_RxD, jnp.zeros((m, d), x_NxD.dtype), recv_start_P, recv_P,
                                         starts_PxP[:, me], send_P, axis_name=expert_axis)
        y_MxD = jnp.zeros((m, d), y_sorted_MxD.dtype).at[order_M].set(y_sorted_MxD)
        return combine(y_MxD, weights_NxK, x_NxD.dtype), _dropped(counts_P, c, token_axes)

    return body


def ragged_all_to_all_by_gather(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name: str):
    """`jax.lax.ragged_all_to_all`'s documented semantics (one slice per device) built from
    all_gather: for backends without the collective (XLA:CPU), and as its reference in tests.
    Gathers every device's operand, so it costs P times the memory of the real collective."""
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [P, rows, ...]
    in_off, sizes, out_off = (jax.lax.all_gather(a, axis_name)[:, me]
                              for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(output.shape[0])
    for src in range(ops.shape[0]):
        inside = (rows >= out_off[src]) & (rows < out_off[src] + sizes[src])
        take = jnp.clip(in_off[src] + rows - out_off[src], 0, operand.shape[0] - 1)
        mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
        output = jnp.where(mask, ops[src][take], output)
    return output

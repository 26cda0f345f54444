"""Expert parallelism: tokens travel to their experts' devices and back by all-to-all in shard_map.

Letters: N tokens on this device, K experts per token, M = N*K (token, slot) rows, P devices on
the expert axis, E experts (E/P local to each device), C rows sent to each device, R = P*C rows
received, D model width.

Per device, inside `shard_map` over the whole mesh (tokens split over TOKEN_AXES, expert weights
split on their leading dimension over `expert`):
1. rows are grouped by destination device (expert // (E/P)) and packed into a [P, C, D] buffer;
2. `all_to_all` over the expert axis: row block p goes to device p, which receives [P, C, D];
3. `local_fn` runs the grouped matmul on the local experts over the rows received: padding rows
   belong to no expert (`valid_R` False), so the work summed over devices is the N*K routed rows
   plus tile rounding, not P x that;
4. `all_to_all` back, rows return to their (token, slot) and are combined with the gate weights.

Tensor ranks share the work: a mesh with `tensor` > 1 holds the same tokens on every tensor rank
(activations are split over the batch axes only), so the shard_map splits them over `tensor` too
(`shard_axes`) and each tensor rank exchanges and computes its own share; the expert weights come
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

from sharding.rules import BATCH_AXES

# (x_RxD, local_expert_R, valid_R, *local_weights) -> y_RxD; rows with valid_R False are padding
# (local_expert_R -1): belonging to no expert, they must cost no work and give zero.
LocalFn = Callable[..., jax.Array]
EXCHANGES = ("auto", "padded", "ragged")
AXIS = "expert"  # the mesh axis the experts are split over
TOKEN_AXES = BATCH_AXES  # axes whose devices hold different tokens (`pipeline` where it is not manual)
SPLIT_AXIS = "tensor"  # an axis whose devices hold the same tokens: each takes a share of them here


def is_active(mesh) -> bool:
    """True when `mesh` (e.g. the context mesh inside jit) splits experts over `expert`."""
    return mesh is not None and not mesh.empty and mesh.shape.get(AXIS, 1) > 1


def _axis_size(mesh, axis: str) -> int:
    """`axis`'s size, 1 where the mesh lacks it or it is manual (inside a shard_map over it)."""
    return 1 if axis in getattr(mesh, "manual_axes", ()) else mesh.shape.get(axis, 1)


def splits_tokens(mesh) -> bool:
    """True when `mesh` splits tokens over any of TOKEN_AXES."""
    return mesh is not None and not mesh.empty and any(_axis_size(mesh, a) > 1 for a in TOKEN_AXES)


def shard_axes(mesh, num_tokens: int) -> tuple[str, ...]:
    """Mesh axes the shard_map splits the tokens over: the TOKEN_AXES the mesh has, then `tensor`
    if it still divides the tokens (module docstring)."""
    axes = tuple(a for a in TOKEN_AXES if _axis_size(mesh, a) > 1)
    with_split = axes + (SPLIT_AXIS,)
    if _axis_size(mesh, SPLIT_AXIS) > 1 and num_tokens % math.prod(mesh.shape[a] for a in with_split) == 0:
        return with_split
    return axes


def token_parallel(x_NxD: jax.Array, experts_NxK: jax.Array, weights_NxK: jax.Array,
                   expert_weights: Sequence[jax.Array], dispatch_fn: Callable[..., jax.Array], *, mesh) -> jax.Array:
    """`dispatch_fn(x, experts, weights, *expert_weights)` on each device's own tokens, with every
    expert's weights whole (gathered, as FSDP gathers any weight). Without this, XLA's partitioner
    gathers every device's routing to sort it globally, and each device computes the whole batch's
    experts: P x the work on a data- or fsdp-split mesh. Tensor ranks share the tokens out as in
    `expert_parallel`."""
    tokens = P(shard_axes(mesh, x_NxD.shape[0]) or None, None)
    return jax.shard_map(dispatch_fn, mesh=mesh, in_specs=(tokens, tokens, tokens, *(P() for _ in expert_weights)),
                         out_specs=tokens, check_vma=False)(x_NxD, experts_NxK, weights_NxK, *expert_weights)


def capacity(rows: int, num_devices: int, capacity_factor: float | None) -> int:
    """Rows each device sends to each device: all of them (dropless) or cf * rows / P."""
    if capacity_factor is None:
        return rows
    return max(1, min(rows, math.ceil(capacity_factor * rows / num_devices)))


def expert_parallel(x_NxD: jax.Array, experts_NxK: jax.Array, weights_NxK: jax.Array,
                    expert_weights: Sequence[jax.Array], local_fn: LocalFn, *, mesh, num_experts: int,
                    capacity_factor: float | None = None, exchange: str = "auto") -> tuple[jax.Array, jax.Array]:
    """sum_k weights[n, k] * Expert_{experts[n, k]}(x[n]) with experts split over `expert`.

    x [N, D] (global), experts/weights [N, K]; each of `expert_weights` has experts on dim 0.
    Tokens are split over the mesh's token axes and shared out over `tensor` (`shard_axes`).
    `exchange`: "auto", "padded" or "ragged" (module docstring). Returns ([N, D] in x's dtype,
    int32 [] dropped (token, expert) pairs, 0 when dropless).
    """
    p = mesh.shape[AXIS]
    if num_experts % p:
        raise ValueError(f"num_experts={num_experts} is not divisible by mesh axis {AXIS}={p}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    token_axes = shard_axes(mesh, x_NxD.shape[0])
    tokens = P(token_axes or None, None)
    weight_specs = tuple(P(AXIS, *([None] * (w.ndim - 1))) for w in expert_weights)

    def run(name):
        exchange_rows = {"padded": _padded_exchange, "ragged": _ragged_exchange}[name]
        body = _body(exchange_rows, local_fn, p, num_experts // p, capacity_factor, token_axes)
        return lambda *args: jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, *weight_specs),
                                           out_specs=(tokens, P()), check_vma=False)(*args)

    args = (x_NxD, experts_NxK, weights_NxK, *expert_weights)
    if exchange == "auto":
        return jax.lax.platform_dependent(*args, cpu=run("padded"), default=run("ragged"))
    return run(exchange)(*args)


def combine(y_MxD: jax.Array, weights_NxK: jax.Array, dtype) -> jax.Array:
    """sum_k weights[n, k] * y[n * K + k] in fp32, returned in `dtype`: the gate-weighted sum of a
    token's expert outputs, rows in (token, slot) order. The one combine (ops/dispatch.py uses it)."""
    n, k = weights_NxK.shape
    out = jnp.einsum("NKD,NK->ND", y_MxD.reshape(n, k, -1), weights_NxK.astype(y_MxD.dtype),
                     preferred_element_type=jnp.float32)
    return out.astype(dtype)


def _body(exchange_rows: Callable, local_fn: LocalFn, p: int, local_experts: int, capacity_factor, token_axes):
    """The per-device program: this device's (token, slot) rows sorted by destination device, sent
    there and computed by `exchange_rows`, put back in (token, slot) order and combined."""
    def body(x_NxD, experts_NxK, weights_NxK, *local_weights):
        n, k = experts_NxK.shape
        m = n * k
        c = capacity(m, p, capacity_factor)
        flat = experts_NxK.reshape(-1)
        dest_M = flat // local_experts
        order_M = jnp.argsort(dest_M, stable=True)
        counts_P = jnp.zeros((p,), jnp.int32).at[dest_M].add(1)
        local_e_M = (flat[order_M] % local_experts).astype(jnp.int32)

        def compute(x_RxD, local_e_R):
            return local_fn(x_RxD, local_e_R, local_e_R >= 0, *local_weights).astype(x_NxD.dtype)

        y_sorted_MxD = exchange_rows(x_NxD[order_M // k], local_e_M, dest_M[order_M], counts_P, c, compute)
        y_MxD = jnp.zeros((m, x_NxD.shape[1]), y_sorted_MxD.dtype).at[order_M].set(y_sorted_MxD)
        # (token, expert) pairs past the capacity, summed over every device holding distinct tokens
        dropped = jnp.sum(jnp.maximum(counts_P - c, 0)).astype(jnp.int32)
        if token_axes:
            dropped = jax.lax.psum(dropped, token_axes)
        return combine(y_MxD, weights_NxK, x_NxD.dtype), dropped

    return body


def _padded_exchange(rows_MxD, local_e_M, dest_M, counts_P, c: int, compute: Callable):
    """Rows sorted by destination -> their results, through [P, C, D] buffers and `all_to_all`."""
    (m, d), p = rows_MxD.shape, counts_P.shape[0]
    slot_M = jnp.arange(m) - (jnp.cumsum(counts_P) - counts_P)[dest_M]
    slot_M = jnp.where(slot_M < c, slot_M, c)  # out of bounds: dropped by the scatter below
    send_PxCxD = jnp.zeros((p, c, d), rows_MxD.dtype).at[dest_M, slot_M].set(rows_MxD, mode="drop")
    send_e_PxC = jnp.full((p, c), -1, jnp.int32).at[dest_M, slot_M].set(local_e_M, mode="drop")

    recv_PxCxD = jax.lax.all_to_all(send_PxCxD, AXIS, 0, 0)
    recv_e_R = jax.lax.all_to_all(send_e_PxC, AXIS, 0, 0).reshape(-1)
    y_RxD = compute(recv_PxCxD.reshape(p * c, d), recv_e_R)

    back_PxCxD = jax.lax.all_to_all(y_RxD.reshape(p, c, d), AXIS, 0, 0)
    return back_PxCxD.at[dest_M, slot_M].get(mode="fill", fill_value=0)


def _ragged_exchange(rows_MxD, local_e_M, dest_M, counts_P, c: int, compute: Callable):
    """Rows sorted by destination -> their results, each device sent only its filled rows by
    `ragged_all_to_all` into a [P * C, D] buffer."""
    del dest_M  # the counts say where each destination's rows start
    (m, d), p = rows_MxD.shape, counts_P.shape[0]
    me = jax.lax.axis_index(AXIS)
    # Everyone's row counts [source, destination], in one collective; sizes and starts follow.
    counts_PxP = jax.lax.all_gather(counts_P, AXIS)
    starts_PxP = jnp.cumsum(counts_PxP, axis=1) - counts_PxP  # where each destination's rows start, sorted
    sent_PxP = jnp.minimum(counts_PxP, c)  # the first C rows of each group go; the rest are dropped
    starts_P, send_P = starts_PxP[me], sent_PxP[me]
    recv_P = sent_PxP[:, me]  # rows arriving from each source
    recv_start_P = jnp.cumsum(recv_P) - recv_P  # sources in order in the receive buffer
    # Where my rows land on each destination j: after the rows of sources before me.
    land_P = jnp.sum(jnp.where(jnp.arange(p)[:, None] < me, sent_PxP, 0), axis=0)

    recv_RxD = _ragged_all_to_all(rows_MxD, jnp.zeros((p * c, d), rows_MxD.dtype), starts_P, send_P, land_P, recv_P)
    recv_e_R = _ragged_all_to_all(local_e_M[:, None], jnp.full((p * c, 1), -1, jnp.int32), starts_P, send_P, land_P,
                                  recv_P)[:, 0]
    y_RxD = compute(recv_RxD, recv_e_R)
    # Back: the block from source i returns to where source i's rows for me started.
    return _ragged_all_to_all(y_RxD, jnp.zeros((m, d), rows_MxD.dtype), recv_start_P, recv_P, starts_PxP[:, me],
                              send_P)


def _ragged_all_to_all(*args):
    """jax.lax.ragged_all_to_all over `expert`, or its all_gather emulation in a program lowered for CPU."""
    return jax.lax.platform_dependent(
        *args, cpu=functools.partial(ragged_all_to_all_by_gather, axis_name=AXIS),
        default=functools.partial(jax.lax.ragged_all_to_all, axis_name=AXIS))


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

"""Expert parallelism: tokens travel to their experts' devices and back by all-to-all in shard_map.

Letters: N tokens on this device, K experts per token, M = N*K (token, slot) rows, P devices on
the expert axis, E experts (E/P local to each device), C rows sent to each device, R = P*C rows
received, D model width.

Per device, inside `shard_map` over the whole mesh (tokens split over `token_axes`, expert weights
split on their leading dimension over `expert_axis`):
1. rows are grouped by destination device (expert // (E/P)) and packed into a [P, C, D] buffer;
2. `all_to_all` over the expert axis: row block p goes to device p, which receives [P, C, D];
3. `local_fn` runs the grouped matmul on the local experts only (invalid padding rows masked);
4. `all_to_all` back, rows return to their (token, slot) and are combined with the gate weights.

Dropless by default: C = M, the worst case (every row of a device choosing one device), so no
token is ever dropped, at the price of P x M received rows of buffer. `capacity_factor` cf sets
C = ceil(cf * M / P); rows past it are dropped (their contribution is zero), as in GShard.
The padded `all_to_all` runs on every backend including CPU; `jax.lax.ragged_all_to_all` (which
sends only the filled rows) does not run on XLA:CPU, see DESIGN.md section 4, so this path is the
one tested here.

No model knowledge: the caller passes the expert weights and the function that applies them.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

LocalFn = Callable[..., jax.Array]  # (x_RxD, local_expert_R, valid_R, *local_weights) -> y_RxD


def is_active(mesh, expert_axis: str = "expert") -> bool:
    """True when `mesh` (e.g. the context mesh inside jit) splits experts over `expert_axis`."""
    return mesh is not None and not mesh.empty and mesh.shape.get(expert_axis, 1) > 1


def capacity(rows: int, num_devices: int, capacity_factor: float | None) -> int:
    """Rows each device sends to each device: all of them (dropless) or cf * rows / P."""
    if capacity_factor is None:
        return rows
    return max(1, min(rows, math.ceil(capacity_factor * rows / num_devices)))


def expert_parallel(x_NxD: jax.Array, experts_NxK: jax.Array, weights_NxK: jax.Array,
                    expert_weights: Sequence[jax.Array], local_fn: LocalFn, *, mesh, num_experts: int,
                    expert_axis: str = "expert", token_axes: Sequence[str] = ("data", "fsdp", "expert"),
                    capacity_factor: float | None = None) -> jax.Array:
    """sum_k weights[n, k] * Expert_{experts[n, k]}(x[n]) with experts split over `expert_axis`.

    x [N, D] (global), experts/weights [N, K]; each of `expert_weights` has experts on dim 0.
    Returns [N, D] in x's dtype.
    """
    p = mesh.shape[expert_axis]
    if num_experts % p:
        raise ValueError(f"num_experts={num_experts} is not divisible by mesh axis {expert_axis}={p}")
    token_axes = tuple(a for a in token_axes if a in mesh.shape and mesh.shape[a] > 1)
    tokens = P(token_axes or None, None)
    weight_specs = tuple(P(expert_axis, *([None] * (w.ndim - 1))) for w in expert_weights)
    body = _local_body(local_fn, p, num_experts // p, expert_axis, capacity_factor)
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, *weight_specs), out_specs=tokens,
                         check_vma=False)(x_NxD, experts_NxK, weights_NxK, *expert_weights)


def _local_body(local_fn: LocalFn, p: int, local_experts: int, expert_axis: str, capacity_factor):
    def body(x_NxD, experts_NxK, weights_NxK, *local_weights):
        n, k = experts_NxK.shape
        d = x_NxD.shape[1]
        m = n * k
        c = capacity(m, p, capacity_factor)
        flat = experts_NxK.reshape(-1)
        dest_M = flat // local_experts
        order_M = jnp.argsort(dest_M, stable=True)
        dest_sorted = dest_M[order_M]
        counts_P = jnp.zeros((p,), jnp.int32).at[dest_M].add(1)
        slot_M = jnp.arange(m) - (jnp.cumsum(counts_P) - counts_P)[dest_sorted]
        keep_M = slot_M < c
        slot_M = jnp.where(keep_M, slot_M, c)  # out of bounds: dropped by the scatter below
        send_PxCxD = jnp.zeros((p, c, d), x_NxD.dtype).at[dest_sorted, slot_M].set(
            x_NxD[order_M // k], mode="drop")
        send_e_PxC = jnp.full((p, c), -1, jnp.int32).at[dest_sorted, slot_M].set(
            (flat[order_M] % local_experts).astype(jnp.int32), mode="drop")

        recv_PxCxD = jax.lax.all_to_all(send_PxCxD, expert_axis, 0, 0)
        recv_e_R = jax.lax.all_to_all(send_e_PxC, expert_axis, 0, 0).reshape(-1)
        valid_R = recv_e_R >= 0
        y_RxD = local_fn(recv_PxCxD.reshape(p * c, d), jnp.where(valid_R, recv_e_R, 0), valid_R, *local_weights)
        y_RxD = jnp.where(valid_R[:, None], y_RxD, 0).astype(x_NxD.dtype)

        back_PxCxD = jax.lax.all_to_all(y_RxD.reshape(p, c, d), expert_axis, 0, 0)
        y_sorted_MxD = back_PxCxD.at[dest_sorted, slot_M].get(mode="fill", fill_value=0)
        y_MxD = jnp.zeros((m, d), y_sorted_MxD.dtype).at[order_M].set(y_sorted_MxD)
        out = jnp.einsum("NKD,NK->ND", y_MxD.reshape(n, k, d), weights_NxK.astype(y_MxD.dtype),
                         preferred_element_type=jnp.float32)
        return out.astype(x_NxD.dtype)

    return body

"""Pipeline parallelism: a layer stack split into stages on `pipeline`, microbatches passed on
with `ppermute` so that stages work at the same time (GPipe schedule, inside shard_map).

Letters: S stages, L layers, Q = ceil(L / S) layer slots per stage, M microbatches.

Layers: the stacked parameters [L, ...] are gathered into [S * Q, ...] slots, stage s holding
slots s*Q .. s*Q + Q - 1. The first L mod S stages get Q real layers and the others Q - 1 (as
balanced as whole layers allow; `stage_layers`); the remaining slots are identity (a validity mask
skips them). DeepSeek-V3's 58 MoE layers on 16 stages: 10 stages of 4 and 6 of 3. The 3 dense
first layers, the embedding, the head and MTP are not staged: they stay outside the pipelined
stack, sharded by the rules like any parameter (the embedding lookup feeds stage 0, the head
reads the last stage's output, which `pipeline_apply` returns to every stage).

Schedule: at tick t (0 <= t < M + S - 1) stage s runs microbatch t - s when 0 <= t - s < M, then
every stage hands its output to stage s + 1 with one `ppermute`. Stage 0 reads microbatch t; the
last stage's output at tick t is microbatch t - S + 1. Idle (stage, tick) slots are the bubble:
(S - 1) / (M + S - 1) of all slots, which `bubble_fraction` gives and the schedule also counts
as it runs (`pipeline_apply(..., return_activity=True)`). The backward pass is the same schedule
reversed (jax differentiates through scan and ppermute).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

LayerFn = Callable[[Any, jax.Array], jax.Array]  # (one layer's params, x) -> x


def slots_per_stage(num_layers: int, num_stages: int) -> int:
    return -(-num_layers // num_stages)


def stage_layers(num_layers: int, num_stages: int) -> list[int]:
    """Real layers on each stage: Q on the first L mod S stages, Q - 1 on the rest (Q on all if even)."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (i < extra) for i in range(num_stages)]


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """GPipe theory: (S - 1) / (M + S - 1) of the stage-ticks are idle."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def layer_slots(num_layers: int, num_stages: int) -> tuple[jax.Array, jax.Array]:
    """(layer index of each of the S * Q slots, bool validity); padding slots point at layer 0."""
    q = slots_per_stage(num_layers, num_stages)
    index, valid, start = [], [], 0
    for count in stage_layers(num_layers, num_stages):
        index += [start + j if j < count else 0 for j in range(q)]
        valid += [j < count for j in range(q)]
        start += count
    return jnp.asarray(index, jnp.int32), jnp.asarray(valid)


def pad_layers(stacked: Any, num_stages: int) -> tuple[Any, jax.Array]:
    """([S * Q, ...] slot params, bool [S * Q] validity) for an [L, ...] stack."""
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    index, valid = layer_slots(num_layers, num_stages)
    return jax.tree.map(lambda x: x[index], stacked), valid


def pipeline_apply(layer_fn: LayerFn, stacked: Any, x_MxB_: jax.Array, *, mesh, axis: str = "pipeline",
                   return_activity: bool = False):
    """Runs x through all layers of `stacked` ([L, ...] leaves), microbatch by microbatch.

    x: [M, ...] microbatches (replicated over `axis`). Returns [M, ...] (and, with
    `return_activity`, the fraction of stage-ticks that did work).
    """
    s = mesh.shape[axis]
    m = x_MxB_.shape[0]
    params, valid = pad_layers(stacked, s)
    param_specs = jax.tree.map(lambda a: P(axis, *([None] * (a.ndim - 1))), params)

    def run_stage(local_params, local_valid, x):
        def body(h, layer):
            p, ok = layer
            return jnp.where(ok, layer_fn(p, h), h), None

        return jax.lax.scan(body, x, (local_params, local_valid))[0]

    def body(local_params, local_valid, xs):
        stage = jax.lax.axis_index(axis)
        perm = [(i, (i + 1) % s) for i in range(s)]

        def tick(carry, t):
            buf, outs, busy = carry
            inp = jnp.where(stage == 0, xs[jnp.minimum(t, m - 1)], buf)
            y = run_stage(local_params, local_valid, inp)
            active = (t - stage >= 0) & (t - stage < m)
            out_i = t - (s - 1)
            write = (stage == s - 1) & (out_i >= 0)
            outs = outs.at[jnp.clip(out_i, 0, m - 1)].set(jnp.where(write, y, outs[jnp.clip(out_i, 0, m - 1)]))
            return (jax.lax.ppermute(y, axis, perm), outs, busy + active.astype(jnp.int32)), None

        init = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs), jnp.zeros((), jnp.int32))
        (_, outs, busy), _ = jax.lax.scan(tick, init, jnp.arange(m + s - 1))
        outs = jax.lax.psum(jnp.where(stage == s - 1, outs, 0), axis)  # results live on the last stage
        activity = jax.lax.psum(busy, axis) / (s * (m + s - 1))
        return outs, activity

    out, activity = jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P(axis), P()), out_specs=(P(), P()),
                                  axis_names={axis}, check_vma=False)(params, valid, x_MxB_)
    return (out, activity) if return_activity else out


def num_microbatches_for(batch: int, num_stages: int, target_bubble: float = 0.2) -> int:
    """Smallest divisor M of `batch` with bubble_fraction(S, M) <= target (else the batch)."""
    for m in range(1, batch + 1):
        if batch % m == 0 and bubble_fraction(num_stages, m) <= target_bubble:
            return m
    return batch

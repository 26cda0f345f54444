"""Pipeline parallelism: a layer stack split into stages on `pipeline`, microbatches passed on
with `ppermute` so that stages work at the same time (GPipe schedule, inside shard_map).

Letters: S stages, L layers, Q = ceil(L / S) layer slots per stage, M microbatches.

Layers: when S divides L, stage s holds layers s*Q .. s*Q + Q - 1 of the stacked parameters as
they are stored (layer axis sharded on `pipeline`: no data moves). Otherwise the [L, ...] stack is
gathered into [S * Q, ...] slots: the first L mod S stages get Q real layers and the others Q - 1
(as balanced as whole layers allow; `stage_layers`), and the remaining slots are identity (a
validity mask skips them). DeepSeek-V3's 58 MoE layers on 16 stages: 10 stages of 4 and 6 of 3.
The gather re-lays the stack every step, so a pipeline size that divides the layer count is the
cheaper choice. The 3 dense first layers, the embedding, the head and MTP are not staged: they run
outside the pipelined stack with the batch rows split over `pipeline` as well (rules.BATCH_AXES),
so each stage does 1/S of that work rather than all of it; their parameters are sharded by the
rules like any other. The stack's input is gathered over `pipeline` (every stage sees all rows;
stage 0 feeds them in), and its output, produced on the last stage, is returned to every stage.

Schedule: at tick t (0 <= t < M + S - 1) stage s runs microbatch t - s when 0 <= t - s < M, then
every stage hands its output to stage s + 1 with one `ppermute`. Stage 0 reads microbatch t; the
last stage's output at tick t is microbatch t - S + 1. Side inputs every layer reads (rope angles,
segment ids) are not passed along: each stage indexes them by the microbatch it runs. Idle
(stage, tick) slots are the bubble: (S - 1) / (M + S - 1) of all slots, which `bubble_fraction`
gives and the schedule also counts as it runs (`return_activity=True`); idle slots compute on
stale data and their results are discarded (SPMD: every stage runs the same program). The backward
pass is the same schedule reversed (jax differentiates through scan and ppermute).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# (one layer's params, x [microbatch...], one microbatch's side inputs) -> (x, per-layer aux pytree)
LayerFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]


def is_active(mesh, axis: str = "pipeline") -> bool:
    """True when `mesh` (e.g. the context mesh inside jit) has more than one `axis` stage."""
    return mesh is not None and not mesh.empty and mesh.shape.get(axis, 1) > 1


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
    """([S * Q, ...] slot params, bool [S * Q] validity) for an [L, ...] stack (as is when S | L)."""
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    if num_layers % num_stages == 0:
        return stacked, jnp.ones((num_layers,), bool)
    index, valid = layer_slots(num_layers, num_stages)
    return jax.tree.map(lambda x: x[index], stacked), valid


def _slot_of_layer(num_layers: int, num_stages: int) -> jax.Array:
    """Slot position of each real layer (the inverse of `layer_slots` on its valid slots)."""
    if num_layers % num_stages == 0:
        return jnp.arange(num_layers)
    _, valid = layer_slots(num_layers, num_stages)
    return jnp.nonzero(valid, size=num_layers)[0]


def pipeline_apply(layer_fn: LayerFn, stacked: Any, x_MxB_: jax.Array, side_M_: Any = None, *, mesh,
                   axis: str = "pipeline", return_activity: bool = False):
    """Runs microbatches x through all layers of `stacked` ([L, ...] leaves) on the `axis` stages.

    x: [M, ...] microbatches; side: a pytree of [M, ...] per-microbatch inputs that every layer reads
    (None for none); both replicated over `axis` (other mesh axes stay automatic). Returns
    (y [M, ...], aux [L, M, ...]) where aux stacks layer_fn's second output per layer and
    microbatch, and with `return_activity` also the fraction of stage-ticks that did work.
    """
    s = mesh.shape[axis]
    m = x_MxB_.shape[0]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    params, valid = pad_layers(stacked, s)
    param_specs = jax.tree.map(lambda a: P(axis, *([None] * (a.ndim - 1))), params)

    def run_stage(local_params, local_valid, x, side):
        def body(h, layer):
            p, ok = layer
            y, aux = layer_fn(p, h, side)
            return jnp.where(ok, y, h), aux

        return jax.lax.scan(body, x, (local_params, local_valid))  # (x, aux [Q, ...])

    def body(local_params, local_valid, xs, side):
        stage = jax.lax.axis_index(axis)
        perm = [(i, (i + 1) % s) for i in range(s)]

        def tick(buf, t):
            micro = jnp.clip(t - stage, 0, m - 1)  # the microbatch this stage runs (when active)
            inp = jnp.where(stage == 0, xs[jnp.minimum(t, m - 1)], buf)
            y, aux = run_stage(local_params, local_valid, inp, jax.tree.map(lambda a: a[micro], side))
            return jax.lax.ppermute(y, axis, perm), (y, aux)

        _, (ys, auxs) = jax.lax.scan(tick, jnp.zeros_like(xs[0]), jnp.arange(m + s - 1))
        # Stage s was active at ticks s .. s + M - 1; the last stage's outputs are the results.
        outs = jax.lax.psum(jnp.where(stage == s - 1, ys[s - 1:], 0), axis)
        auxs = jax.tree.map(lambda a: jnp.swapaxes(jax.lax.dynamic_slice_in_dim(a, stage, m, 0), 0, 1), auxs)
        ticks = jnp.arange(m + s - 1)
        busy = jnp.sum((ticks >= stage) & (ticks < stage + m))
        activity = jax.lax.psum(busy, axis) / (s * (m + s - 1))
        return outs, auxs, activity

    aux_spec = P(axis)
    out, aux, activity = jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P(axis), P(), P()),
                                       out_specs=(P(), aux_spec, P()), axis_names={axis},
                                       check_vma=False)(params, valid, x_MxB_, side_M_)
    aux = jax.tree.map(lambda a: a[_slot_of_layer(num_layers, s)], aux)  # [S * Q, M, ...] -> [L, M, ...]
    return (out, aux, activity) if return_activity else (out, aux)


def split_microbatches(x_Bx_: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...], microbatch i = rows i, i + M, i + 2M, ... (a batch split in
    contiguous blocks over devices stays where it is when each device's block divides by M)."""
    b = x_Bx_.shape[0]
    return jnp.swapaxes(x_Bx_.reshape(b // m, m, *x_Bx_.shape[1:]), 0, 1)


def merge_microbatches(x_MxB_: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`."""
    m, mb = x_MxB_.shape[:2]
    return jnp.swapaxes(x_MxB_, 0, 1).reshape(m * mb, *x_MxB_.shape[2:])


def num_microbatches_for(batch: int, num_stages: int, target_bubble: float = 0.2, batch_shards: int = 1) -> int:
    """Microbatch count for a batch of `batch` rows split over `batch_shards` devices: the smallest
    M with bubble_fraction(S, M) <= target among those that keep every microbatch splittable over
    the shards ((batch / M) % batch_shards == 0); the largest such M when none reaches the target."""
    feasible = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % batch_shards == 0]
    if not feasible:
        raise ValueError(f"batch of {batch} rows cannot be split over {batch_shards} devices")
    for m in feasible:
        if bubble_fraction(num_stages, m) <= target_bubble:
            return m
    return feasible[-1]


def resolve_microbatches(batch: int, num_stages: int, batch_shards: int = 1, requested: int = 0) -> int:
    """`requested` microbatches (checked), or `num_microbatches_for`'s choice when it is 0."""
    if not requested:
        return num_microbatches_for(batch, num_stages, batch_shards=batch_shards)
    if batch % requested or (batch // requested) % batch_shards:
        raise ValueError(f"pipeline_microbatches={requested} must divide the batch of {batch} rows into "
                         f"microbatches that split evenly over the mesh's {batch_shards} batch shards")
    return requested

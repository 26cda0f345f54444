"""Pipeline parallelism: a layer stack split into stages on `pipeline`, microbatches passed on
with `ppermute` so that stages work at the same time (GPipe or circular schedule, in shard_map).

Letters: S stages, L layers, M microbatches, R rounds (`repeats`; 1 = GPipe), C = R * S chunks of
K = ceil(L / C) layer slots; each stage holds R * K slots.

Layers: the stack is cut into C chunks, balanced like `stage_layers` (58 MoE layers on 16 stages:
10 stages of 4 and 6 of 3); chunk c = r * S + s runs on stage s in round r. With R = 1 and S
dividing L this is the stored layout (layer axis sharded on `pipeline`: no data moves). Otherwise
the [L, ...] stack is moved into stage-major [S * R * K, ...] slots every step, padding slots
are identity (a validity mask skips them); the rules shard such a stack over `pipeline` on
another dimension (rules.py), and `to_slots` hands each stage its slots with one all_to_all (each
stage then holds a copy of its slots and their gradients beside the stored shards). Each stage computes all
its slots, padding included: an uneven split costs as much as K layers per chunk.

The 3 dense first layers, the embedding, the head and MTP are not staged: they run outside the
pipelined stack with the batch rows split over `pipeline` as well (rules.BATCH_AXES), so each
stage does 1/S of that work rather than all of it. Under GPipe and circular the stack's input is
gathered over `pipeline` (stage 0 feeds it in), and its output, produced on the last stage, is
returned to every stage (the hand-run schedules keep both split: below).
Those outer layers also run in microbatches of their own (`map_microbatches`, by default one row
per device at a time: `outer_microbatches`), one after another and each recomputed in the
backward, so a device never holds its whole batch's logits or an outer layer's working set.

Schedule: at tick t (0 <= t < R * M + S - 1) stage s runs step t - s = r * M + m (microbatch m of
round r, on chunk r * S + s) when 0 <= t - s < R * M, then every stage hands its output to stage
(s + 1) mod S with one `ppermute`. Stage 0 reads microbatch t in round 0; in later rounds it reads
what came round the ring from stage S - 1, kept in a buffer of M microbatches until its turn
(this needs M >= S). The last stage's final-round outputs are the result. Side inputs every layer
reads (rope angles, segment ids) are not passed along: each stage indexes them by the microbatch
it runs. Idle (stage, tick) slots are the bubble, (S - 1) / (R * M + S - 1) of all slots, which
`bubble_fraction` gives (tests/sharding/pipeline_worker.py counts it in the compiled program). Idle
slots compute on stale data and their results are discarded (SPMD: every stage runs the same
program). The backward pass is the same schedule reversed (jax differentiates through scan and
ppermute), so every microbatch's residuals live until the backward starts: memory grows with M.
Rounds cut the bubble by R at the same M, at the price of R times the hand-offs.

Schedules whose backward runs by hand (a custom_vjp around the stack: the forward is GPipe's and
keeps only its inputs; the backward re-runs each stage's forward under `jax.vjp` in its own order):
- 1f1b (`_one_f_one_b_backward`): forwards and backwards alternate on each stage, at most S
  microbatches' residuals in flight, weight gradients accumulated as produced;
- dualpipev (sharding/dualpipev.py): 2S chunks in a V over the stages, forward and backward chunks
  of different microbatches in one unit, the weight-gradient half of each backward deferred.
Their price is one more forward of the stack (as `remat` pays per layer); side inputs get no gradient.
Under both, when S divides M, the stack's input, output and their gradients stay split over the
stages on the microbatch dimension (sharding/stage_batch.py, whose `split_stage_microbatches` the
model splits its batch with, so that each stage's microbatches are rows it already holds): the
first stage reads x and writes its gradient, the stage producing y (1F1B's last, DualPipeV's first)
writes it and reads its cotangent, one microbatch per tick through a psum over `pipeline` of the
owning stage's slot, so no stage holds a whole-batch [M, ...] buffer. (That psum moves 2 (S - 1) / S
microbatches per tick and device where a gather moves each microbatch once; memory is the point.)
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding import dualpipev
from sharding.rules import BATCH_AXES, STAGE_BATCH_AXES
from sharding.stage_batch import StageBatch, splits_stack_batch
from sharding.stages import (ChunkVjp, LayerFn, chunk_slots, grad_accumulator, hand_run, run_chunk, slot_of_layer,
                             stage_layers, stage_specs, to_slots, AXIS)

SCHEDULES = ("gpipe", "circular", "1f1b", "dualpipev")


def is_active(mesh) -> bool:
    """True when `mesh` (e.g. the context mesh inside jit) has more than one `pipeline` stage."""
    return mesh is not None and not mesh.empty and mesh.shape.get(AXIS, 1) > 1


def slots_per_stage(num_layers: int, num_stages: int, repeats: int = 1) -> int:
    """Layer slots each stage holds: `repeats` chunks of ceil(L / (repeats * S)) slots."""
    return repeats * -(-num_layers // (num_stages * repeats))


def bubble_fraction(num_stages: int, num_microbatches: int, repeats: int = 1) -> float:
    """Idle share of the stage-ticks: (S - 1) / (R * M + S - 1) (GPipe when R = 1)."""
    return (num_stages - 1) / (repeats * num_microbatches + num_stages - 1)


def layer_slots(num_layers: int, num_stages: int, repeats: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(layer index of each of the S * R * K slots in stage-major order, bool validity).

    The stack is cut into C = R * S chunks of K = ceil(L / C) slots, balanced like `stage_layers`;
    chunk c = r * S + s runs on stage s in round r, so stage s holds chunks s, S + s, ... in order.
    Padding slots point at layer 0.
    """
    return chunk_slots(num_layers, [[r * num_stages + s for r in range(repeats)] for s in range(num_stages)])


def pipeline_apply(layer_fn: LayerFn, stacked: Any, x_MxB_: jax.Array, side_M_: Any = None, *, mesh,
                   repeats: int = 1, schedule: str | None = None, stored_specs: Any = None):
    """Runs microbatches x through all layers of `stacked` ([L, ...] leaves) on the `pipeline` stages.

    x: [M, ...] microbatches; side: a pytree of [M, ...] per-microbatch inputs that every layer reads
    (None for none); side replicated over `pipeline`, x too except under 1f1b and dualpipev when S
    divides M: split there on the microbatch dimension, as is y (`splits_stack_batch`; other mesh
    axes stay automatic). `schedule` (default: gpipe, or circular when `repeats` R > 1) is one of
    SCHEDULES: circular makes each microbatch go round the ring of stages R times, stage s holding
    chunks s, S + s, ... (needs M >= S); 1f1b runs the same forward and its own backward
    (`_one_f_one_b_backward`); dualpipev lays the stack out as a V of 2S chunks with a forward and
    backward of its own (sharding/dualpipev.py). Side inputs get no gradient under those two.
    Returns (y [M, ...], aux [L, M, ...]) where aux stacks layer_fn's second output per layer and
    microbatch. `stored_specs` (PartitionSpecs of `stacked`, optional) lets an uneven split move
    each stage's layers with `to_slots`'s all_to_all instead of a gather.
    """
    s = mesh.shape[AXIS]
    m = x_MxB_.shape[0]
    schedule = schedule or ("circular" if repeats > 1 else "gpipe")
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {schedule!r}")
    if (schedule == "circular") != (repeats > 1):
        raise ValueError(f"the {schedule} schedule takes " + ("repeats >= 2" if schedule == "circular" else "repeats=1")
                         + f", got repeats={repeats}")
    if repeats > 1 and m < s:
        raise ValueError(f"the circular schedule (repeats={repeats}) needs at least as many microbatches as "
                         f"stages: {m} < {s}")
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    split = splits_stack_batch(schedule, m, s)
    if schedule == "dualpipev":  # its own layout (a V of 2S chunks) and program
        return dualpipev.apply(layer_fn, stacked, x_MxB_, side_M_, mesh=mesh, stored_specs=stored_specs, split=split)
    index, valid = layer_slots(num_layers, s, repeats)
    if repeats == 1 and num_layers % s == 0:  # the stored layout: no data moves
        params = stacked
    else:
        params = to_slots(stacked, index, stored_specs, mesh=mesh)
    if schedule == "1f1b":  # GPipe's forward, keeping only its inputs; the 1F1B backward by hand
        run = hand_run(functools.partial(_gpipe, layer_fn, valid, mesh=mesh, repeats=1, hand=True,
                                         split=split),
                       functools.partial(_one_f_one_b_backward, layer_fn, valid, mesh=mesh, split=split))
    else:
        run = functools.partial(_gpipe, layer_fn, valid, mesh=mesh, repeats=repeats)
    out, aux = run(params, x_MxB_, side_M_)
    return out, jax.tree.map(lambda a: a[slot_of_layer(index, valid)], aux)  # slots -> [L, M, ...]


def _gpipe(layer_fn: LayerFn, valid: np.ndarray, params, x_MxB_, side_M_, *, mesh, repeats: int,
           hand: bool = False, split: bool = False):
    """The GPipe / circular forward over slot params [S * R * K, ...]: (y [M, ...], aux slots
    [S * R * K, M, ...]). Its backward is jax's transpose of the scan and ppermutes.
    `hand` (the forward of a hand-run backward, never differentiated by jax): the last stage writes
    each output as it is produced (`StageBatch`), x and y split over `pipeline` when `split`."""
    s = mesh.shape[AXIS]
    m = x_MxB_.shape[0]
    param_specs = stage_specs(params)
    ticks = repeats * m + s - 1
    batch = StageBatch(split, m, s)

    def body(local_params, local_valid, xs, side):
        stage = jax.lax.axis_index(AXIS)
        perm = [(i, (i + 1) % s) for i in range(s)]
        by_round = jax.tree.map(lambda a: a.reshape(repeats, -1, *a.shape[1:]), (local_params, local_valid))

        def tick(carry, t):
            buf, loop, outs = carry
            step = jnp.clip(t - stage, 0, repeats * m - 1)
            rnd, micro = step // m, step % m  # this stage runs microbatch `micro` of round `rnd`
            if repeats > 1:  # stage 0 keeps what comes round the ring until its next round starts
                slot = jnp.maximum(t - s, 0) % m
                keep = (stage == 0) & (t >= s)
                loop = jax.lax.dynamic_update_index_in_dim(loop, jnp.where(keep, buf, loop[slot]), slot, 0)
                first = jnp.where(t < m, xs[jnp.minimum(t, m - 1)], loop[t % m])
            else:
                first = batch.read(xs, jnp.minimum(t, m - 1))
            inp = jnp.where(stage == 0, first, buf)
            # One round: the stage's slots as they are, loop-invariant, so autodiff keeps them once
            # rather than a copy per tick (indexed by the traced round, [ticks, K, ...] of weights).
            chunk = (local_params, local_valid) if repeats == 1 else jax.tree.map(lambda a: a[rnd], by_round)
            y, aux = run_chunk(layer_fn, *chunk, inp, jax.tree.map(lambda a: a[micro], side))
            if hand:  # the last stage finishes microbatch t - (S - 1)
                done = t - (s - 1)
                outs = batch.write(outs, y, jnp.maximum(done, 0), done >= 0, src=s - 1)
            return (jax.lax.ppermute(y, AXIS, perm), loop, outs), (None if hand else y, aux)

        loop0 = jnp.zeros_like(xs) if repeats > 1 else jnp.zeros((), xs.dtype)
        outs0 = jnp.zeros_like(xs) if hand else jnp.zeros((), xs.dtype)
        (_, _, outs), (ys, auxs) = jax.lax.scan(tick, (jnp.zeros_like(xs[0]), loop0, outs0), jnp.arange(ticks))
        if hand:
            outs = batch.result(outs, src=s - 1)
        else:  # Stage s is active at ticks s .. s + R*M - 1; the last stage's final round is the result.
            outs = jax.lax.psum(jnp.where(stage == s - 1, ys[ticks - m:], 0), AXIS)

        def per_slot(a):  # [ticks, K, ...] -> this stage's [R * K, M, ...]
            a = jax.lax.dynamic_slice_in_dim(a, stage, repeats * m, 0).reshape(repeats, m, *a.shape[1:])
            return jnp.swapaxes(a, 1, 2).reshape(-1, m, *a.shape[3:])

        return outs, jax.tree.map(per_slot, auxs)

    return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P(AXIS), batch.spec(), P()),
                         out_specs=(batch.spec(), P(AXIS)), axis_names={AXIS},
                         check_vma=False)(params, jnp.asarray(valid), x_MxB_, side_M_)


def _one_f_one_b_backward(layer_fn: LayerFn, valid: np.ndarray, params, xs, side, ct_y, ct_aux: list, *, mesh,
                          split: bool = False):
    """Gradients (slot params [S * K, ...], x [M, ...]) of sum(y * ct_y) + sum(aux * ct_aux), run by
    the 1F1B schedule in one shard_map over `pipeline`.

    Stage s runs the forward of microbatch m at unit s + 2m and its backward at unit 2S - 1 - s + 2m
    (never the same unit: the parities differ), handing activations to s + 1 and input gradients to
    s - 1 with one ppermute each per unit. The forward keeps the residuals of the stage's `jax.vjp`
    (its parameters excepted: they are read again) in slot m mod S until the backward reads them;
    at most S - s microbatches are in flight on stage s, so this buffer does not grow with M. Weight
    gradients are added up as each backward produces them. An idle (stage, unit) runs neither branch
    (`lax.switch` on the stage's own op). x, ct_y and the x gradient are `StageBatch`es (split over
    `pipeline` when `split`): each unit reads the first stage's x and the last stage's ct_y and stores
    the first stage's input gradient, one microbatch each.
    """
    s = mesh.shape[AXIS]
    m = xs.shape[0]
    param_specs = stage_specs(params)
    aux_specs = [P(AXIS)] * len(ct_aux)
    batch = StageBatch(split, m, s)

    def body(local_params, local_valid, xs, side, ct_y, ct_aux):
        stage = jax.lax.axis_index(AXIS)
        side_of = lambda i: jax.tree.map(lambda a: a[i], side)  # noqa: E731
        chunk_vjp = ChunkVjp(layer_fn)
        _, res_shapes = jax.eval_shape(chunk_vjp.forward, local_params, local_valid, xs[0], side_of(0))
        stash0 = [jnp.zeros((s, *r.shape), r.dtype) for r in res_shapes]
        grads0 = grad_accumulator(local_params)

        # recv_act / recv_grad: what came from the stage before / after; the first stage's comes
        # from x, the last stage's from ct_y (read before the switch: a psum every stage joins)
        def forward(carry, recv_act, recv_grad, fm, bm):
            stash, grads = carry
            y, res = chunk_vjp.forward(local_params, local_valid, recv_act, side_of(fm))
            stash = [jax.lax.dynamic_update_index_in_dim(b, r, fm % s, 0) for b, r in zip(stash, res)]
            return (stash, grads), y, jnp.zeros_like(recv_grad)

        def backward(carry, recv_act, recv_grad, fm, bm):
            stash, grads = carry
            dp, dh = chunk_vjp.vjp(local_params, [b[bm % s] for b in stash])((recv_grad, [a[:, bm] for a in ct_aux]))
            grads = jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), grads, dp)
            return (stash, grads), jnp.zeros_like(recv_act), dh

        def idle(carry, recv_act, recv_grad, fm, bm):
            return carry, jnp.zeros_like(recv_act), jnp.zeros_like(recv_grad)

        def unit(state, u):
            carry, dxs, recv_act, recv_grad = state
            fm, bm = (u - stage) // 2, (u - (2 * s - 1 - stage)) // 2
            does_f = ((u - stage) % 2 == 0) & (fm >= 0) & (fm < m)
            does_b = ((u - stage) % 2 == 1) & (bm >= 0) & (bm < m)
            op = jnp.where(does_f, 1, jnp.where(does_b, 2, 0))
            fm, bm = jnp.clip(fm, 0, m - 1), jnp.clip(bm, 0, m - 1)
            # the first stage forwards microbatch u / 2, the last one's backward reads (u - S) / 2
            recv_act = jnp.where(stage == 0, batch.read(xs, jnp.clip(u // 2, 0, m - 1)), recv_act)
            recv_grad = jnp.where(stage == s - 1, batch.read(ct_y, jnp.clip((u - s) // 2, 0, m - 1)), recv_grad)
            carry, send_act, send_grad = jax.lax.switch(op, (idle, forward, backward), carry, recv_act, recv_grad,
                                                        fm, bm)
            first_b = (u - (2 * s - 1)) // 2  # the first stage's backward: the stack's input gradient
            first_on = (u % 2 == 1) & (first_b >= 0) & (first_b < m)
            dxs = batch.write(dxs, send_grad, jnp.clip(first_b, 0, m - 1), first_on, src=0)
            recv_act = jax.lax.ppermute(send_act, AXIS, [(i, i + 1) for i in range(s - 1)])
            recv_grad = jax.lax.ppermute(send_grad, AXIS, [(i + 1, i) for i in range(s - 1)])
            return (carry, dxs, recv_act, recv_grad), None

        # the last unit (stage 0's backward of microbatch M - 1) is 2 (M + S - 1) - 1
        init = ((stash0, grads0), jnp.zeros_like(xs), jnp.zeros_like(xs[0]), jnp.zeros_like(xs[0]))
        ((_, grads), dxs, _, _), _ = jax.lax.scan(unit, init, jnp.arange(2 * (m + s - 1)))
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, local_params)
        return grads, batch.result(dxs, src=0)

    return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P(AXIS), batch.spec(), P(), batch.spec(), aux_specs),
                         out_specs=(param_specs, batch.spec()), axis_names={AXIS},
                         check_vma=False)(params, jnp.asarray(valid), xs, side, ct_y, ct_aux)


def split_microbatches(x_Bx_: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...], microbatch i = rows i, i + M, i + 2M, ... (a batch split in
    contiguous blocks over devices stays where it is when each device's block divides by M)."""
    b = x_Bx_.shape[0]
    return jnp.swapaxes(x_Bx_.reshape(b // m, m, *x_Bx_.shape[1:]), 0, 1)


def merge_microbatches(x_MxB_: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`."""
    m, mb = x_MxB_.shape[:2]
    return jnp.swapaxes(x_MxB_, 0, 1).reshape(m * mb, *x_MxB_.shape[2:])


def outer_microbatches(batch: int, mesh, requested: int = 0) -> int:
    """Microbatches of the layers outside the stack for `batch` rows: `requested` (checked: each
    microbatch must split evenly over the batch shards, rules.BATCH_AXES), or when 0, on a mesh
    with a pipeline, each device's rows one at a time (batch / shards), else 1 (the whole batch)."""
    shards = math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES) if mesh is not None and not mesh.empty else 1
    if not requested:
        return batch // shards if is_active(mesh) and batch % shards == 0 else 1
    return _check_microbatches("outer_microbatches", requested, batch, shards)


def _check_microbatches(name: str, requested: int, batch: int, shards: int) -> int:
    """`requested` when it splits `batch` rows into microbatches that split evenly over `shards`."""
    if batch % requested or (batch // requested) % shards:
        raise ValueError(f"{name}={requested} must divide the batch of {batch} rows into "
                         f"microbatches that split evenly over the mesh's {shards} batch shards")
    return requested


def map_microbatches(fn: Callable, args: Any, m: int) -> Any:
    """`fn` over the `m` microbatches of `args` (a pytree of [B, ...] leaves, `split_microbatches`)
    one after another, each rematerialised in the backward (only its inputs are kept): fn's outputs
    stacked [M, ...]. A device's block of rows stays on it when its row count divides by `m`, and
    inside the loop each microbatch's rows (and fn's outputs with rows) are held split over the
    mesh's batch axes (rules.BATCH_AXES): without that, XLA:SPMD kept a microbatch's activations
    whole over `pipeline` in the dense layers (partial sums all-reduced over the weight's split)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in BATCH_AXES if not mesh.empty and mesh.shape.get(a, 1) > 1
                 and a not in mesh.manual_axes)

    rows = jax.tree.leaves(args)[0].shape[0] // m
    shards = math.prod(mesh.shape[a] for a in axes)

    def rows_split(tree):  # [rows, ...] leaves of one microbatch stay split over the batch axes
        if not axes or rows % shards:
            return tree
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, P(axes, *([None] * (a.ndim - 1))))
                            if a.ndim and a.shape[0] == rows else a, tree)

    def body(xs):
        return rows_split(fn(rows_split(xs)))

    return jax.lax.map(jax.checkpoint(body), jax.tree.map(lambda a: split_microbatches(a, m), args))


def stage_batch_shards(mesh) -> int:
    """Devices one microbatch's rows are split over inside the stack (rules.STAGE_BATCH_AXES)."""
    return math.prod(mesh.shape.get(a, 1) for a in STAGE_BATCH_AXES)


def check_schedule(mesh, *, num_layers: int, batch: int, microbatches: int = 0, repeats: int = 1) -> int:
    """The microbatch count for `batch` rows on `mesh`'s `pipeline` stages, after checking that every
    stage gets a layer (chunks of the circular schedule may be empty) and that the microbatches
    split over the stage batch shards. Raises ValueError naming what does not fit."""
    stages = mesh.shape[AXIS]
    if stages > num_layers:
        raise ValueError(f"pipeline={stages} stages exceed the {num_layers} layers they split")
    return resolve_microbatches(batch, stages, stage_batch_shards(mesh), microbatches, repeats)


def resolve_microbatches(batch: int, num_stages: int, batch_shards: int = 1, requested: int = 0, repeats: int = 1,
                         target_bubble: float = 0.2) -> int:
    """`requested` microbatches for a batch of `batch` rows split over `batch_shards` devices
    (checked), or when 0 the smallest M with bubble_fraction(S, M, R) <= target among those that
    keep every microbatch splittable over the shards ((batch / M) % batch_shards == 0) and, for the
    circular schedule, M >= S; the largest such M when none reaches the target."""
    if requested:
        _check_microbatches("pipeline_microbatches", requested, batch, batch_shards)
        if repeats > 1 and requested < num_stages:
            raise ValueError(f"pipeline_microbatches={requested} is fewer than the {num_stages} stages; the circular "
                             f"schedule (pipeline_repeats={repeats}) needs at least one per stage")
        return requested
    feasible = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % batch_shards == 0
                and (repeats == 1 or m >= num_stages)]
    if not feasible:
        raise ValueError(f"batch of {batch} rows cannot be split over {batch_shards} devices"
                         + (f" into at least {num_stages} microbatches (pipeline_repeats={repeats})" if repeats > 1
                            else ""))
    for m in feasible:
        if bubble_fraction(num_stages, m, repeats) <= target_bubble:
            return m
    return feasible[-1]

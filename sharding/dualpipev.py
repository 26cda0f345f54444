"""DualPipeV: the stack cut into 2S chunks laid out as a V over S stages, run by a static table.

Letters: S stages (ranks), C = 2S chunks of K = ceil(L / C) layer slots, M microbatches, U units.

Placement: rank r holds chunks r and 2S - 1 - r (its local chunks v = 0 and v = 1), so a microbatch
goes down the ranks 0 .. S-1 through chunks 0 .. S-1 and back up S-1 .. 0 through chunks S .. 2S-1:
both ends of the model sit on rank 0, the middle on rank S-1 (one copy of the weights, unlike
DualPipe's two). Activations of chunks < S travel to r + 1 and of chunks >= S to r - 1; their input
gradients the other way; at the V's tip (rank S-1) the hand-off is local.

Schedule: `schedule_table` simulates the ranks unit by unit and writes what each does. In one unit
a rank may run a forward chunk (F), the input-gradient half of a backward chunk (B) of another
microbatch, and a deferred weight-gradient half (W). B comes first whenever its cotangent has
arrived (the deepest chunk first); F runs while its chunk has fewer than 2S - c microbatches
between F and B in flight (1F1B's bound on the 2S virtual stages, so stash memory does not grow
with M); W runs in units where the rank does not run both F and B, or when more than `w_lag` are
waiting. Every buffer slot (inboxes for arriving activations and gradients, residual stash, the
cotangents W needs) is assigned in the table, so the program only indexes.

The program (`_run`): a scan over units inside shard_map over `pipeline`; each unit runs W, B, F under
`lax.cond` on this rank's row of the table, then four ppermutes (activations and gradients, to
r + 1 and to r - 1) whose results land in the slots the table names. B and W both call the chunk's
`jax.vjp` function rebuilt from the stashed residuals: B keeps only the input gradient, W only the
weight gradient (XLA drops the unused half of each; W re-runs the input-gradient chain inside the
chunk that its weight gradients need). Cond boundaries keep XLA from overlapping one chunk's MoE
exchange with the other's compute: the overlap is in the schedule, not yet in the compiled program.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding import stages
from sharding.stage_batch import StageBatch
from sharding.stages import AXIS


def v_layer_slots(num_layers: int, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """(layer index, validity) of the S * 2 * K slots, rank-major: rank r holds chunk r's K slots then
    chunk 2S - 1 - r's. Chunks are balanced like `stage_layers`; padding slots point at layer 0."""
    return stages.chunk_slots(num_layers, [[r, 2 * num_stages - 1 - r] for r in range(num_stages)])


def v_layout(stacked, *, mesh, stored_specs=None):
    """The [L, ...] stack in V slot order ([S * 2K, ...], `v_layer_slots`), split over `pipeline`.

    When 2S divides L, the stored layout (layer axis on `pipeline`: stage q holds chunks 2q and 2q + 1)
    is turned into the V's by two ppermutes of one chunk each: even chunks 2q go to rank(2q), odd
    ones to rank(2q + 1), both injective (a chunk c < S lands on rank c, of c's parity; c >= S on
    2S - 1 - c, of the other parity), and each rank receives one of each (r and 2S - 1 - r differ
    in parity). Each stage moves its own weights only. Otherwise (padding slots) `pipeline.to_slots`
    moves them with one all_to_all given the stack's `stored_specs`; without those the stack is
    gathered by layer index, which XLA did by all-gathering the whole stack on every stage.
    """
    s = mesh.shape[AXIS]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    if num_layers % (2 * s):
        index, _ = v_layer_slots(num_layers, s)
        return stages.to_slots(stacked, index, stored_specs, mesh=mesh)
    k = num_layers // (2 * s)
    rank = lambda c: c if c < s else 2 * s - 1 - c  # noqa: E731

    def body(local):  # [2K, ...]: chunks 2q, 2q + 1 of this stage q
        even = jax.lax.ppermute(jax.tree.map(lambda a: a[:k], local), AXIS, [(q, rank(2 * q)) for q in range(s)])
        odd = jax.lax.ppermute(jax.tree.map(lambda a: a[k:], local), AXIS, [(q, rank(2 * q + 1)) for q in range(s)])
        first_even = jax.lax.axis_index(AXIS) % 2 == 0  # chunk r (slot 0) is even on even ranks
        return jax.tree.map(lambda e, o: jnp.where(first_even, jnp.concatenate([e, o]), jnp.concatenate([o, e])),
                            even, odd)

    specs = stages.stage_specs(stacked)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs, axis_names={AXIS},
                         check_vma=False)(stacked)


_FIELDS = ("f_on", "f_v", "f_m", "f_in", "f_res", "f_loc", "b_on", "b_v", "b_m", "b_in", "b_res", "b_w", "b_loc",
           "w_on", "w_v", "w_m", "w_res", "w_slot", "a_below", "a_above", "g_below", "g_above")


@dataclass(frozen=True)
class Table:
    """What every rank does in every unit: each field an int array [U, S] (see `_FIELDS`; -1 for
    in-slots means the step's own input: x for chunk 0's F, the output cotangent for chunk 2S-1's B;
    writes that go nowhere name the dump slot, the buffer's last). Sizes count slots, dump included."""

    rows: dict
    units: int
    inbox_a: int  # arriving activations
    inbox_g: int  # arriving input gradients
    stash: int  # residuals held from F until W
    wait_w: int  # cotangents held from B until W
    busy: float  # share of (rank, unit, kind) slots that run an op, F + B + W kinds


class _Slots:
    def __init__(self):
        self.free, self.size = [], 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.size += 1
        return self.size - 1

    def give(self, i: int) -> None:
        self.free.append(i)


def schedule_table(num_stages: int, num_microbatches: int, *, backward: bool = True, w_lag: int = 2) -> Table:
    """Simulates the DualPipeV ranks (see the module docstring) and returns their table. With
    `backward=False`, forwards only (the custom_vjp's forward pass)."""
    s, m, chunks = num_stages, num_microbatches, 2 * num_stages
    rank = lambda c: c if c < s else chunks - 1 - c  # noqa: E731
    f_done = np.full((chunks, m), -1)  # the unit each op ran in
    b_done = np.full((chunks, m), -1)
    next_f, next_b = [0] * chunks, [0] * chunks
    w_queue = [[] for _ in range(s)]  # (c, m, res slot, w slot, unit of its B)
    a_slots, g_slots, r_slots, w_slots = ([_Slots() for _ in range(s)] for _ in range(4))
    a_of, g_of, res_of = {}, {}, {}  # (c, m) -> slot on the consuming rank
    rows, busy, u = [], 0, 0
    while (min(next_b) if backward else min(next_f)) < m or any(w_queue):
        if u > 8 * (m + chunks) + 64:
            raise RuntimeError(f"DualPipeV table for S={s}, M={m} does not finish")  # a bug, not an input error
        row = {f: [-1] * s for f in _FIELDS}
        for f in ("f_on", "b_on", "w_on"):
            row[f] = [0] * s
        sent_f, sent_b = [], []
        for r in range(s):
            mine = (r, chunks - 1 - r)
            did = 0
            # B: the chunk nearest the loss whose cotangent has arrived
            for v, c in sorted(enumerate(mine), key=lambda vc: -vc[1]):
                j = next_b[c]
                if not backward or j >= m or f_done[c, j] < 0 or f_done[c, j] >= u:
                    continue
                if c < chunks - 1 and not (0 <= b_done[c + 1, j] < u):
                    continue
                slot_w = w_slots[r].take()
                for f, val in (("b_on", 1), ("b_v", v), ("b_m", j), ("b_res", res_of[c, j]), ("b_w", slot_w),
                               ("b_in", g_of.pop((c, j)) if c < chunks - 1 else -1)):
                    row[f][r] = val
                if row["b_in"][r] >= 0:
                    g_slots[r].give(row["b_in"][r])
                w_queue[r].append((c, j, res_of.pop((c, j)), slot_w, u))
                b_done[c, j], next_b[c], did = u, j + 1, did + 1
                sent_b.append((r, c, j))
                break
            # F: the deepest chunk whose input has arrived, within 1F1B's in-flight bound
            for v, c in sorted(enumerate(mine), key=lambda vc: -vc[1]):
                j = next_f[c]
                if j >= m or (c > 0 and not (0 <= f_done[c - 1, j] < u)):
                    continue
                if backward and j - next_b[c] >= chunks - c:
                    continue
                for f, val in (("f_on", 1), ("f_v", v), ("f_m", j), ("f_in", a_of.pop((c, j)) if c > 0 else -1)):
                    row[f][r] = val
                if row["f_in"][r] >= 0:
                    a_slots[r].give(row["f_in"][r])
                if backward:
                    res_of[c, j] = row["f_res"][r] = r_slots[r].take()
                f_done[c, j], next_f[c], did = u, j + 1, did + 1
                sent_f.append((r, c, j))
                break
            # W: deferred weight gradients fill units without both F and B
            # (not one whose B runs in this unit: the program runs W before B)
            ready_w = [w for w in w_queue[r] if w[4] < u]
            if ready_w and (did < 2 or len(w_queue[r]) > w_lag or min(next_b) >= m):
                c, j, res, slot_w, _ = ready_w[0]
                w_queue[r].remove(ready_w[0])
                for f, val in (("w_on", 1), ("w_v", int(c >= s)), ("w_m", j), ("w_res", res), ("w_slot", slot_w)):
                    row[f][r] = val
                # freed at the end of the unit: W runs first in the program, but the table's F
                # above may have taken a slot this unit before this W released its own
                r_slots[r].give(res)
                w_slots[r].give(slot_w)
                did += 1
            busy += did
        for r, c, j in sent_f:  # outputs land in the next chunk's inbox at the end of the unit
            if c == chunks - 1:
                continue
            dest = rank(c + 1)
            a_of[c + 1, j] = slot = a_slots[dest].take()
            row["f_loc" if dest == r else ("a_below" if dest == r + 1 else "a_above")][dest] = slot
        for r, c, j in sent_b:
            if c == 0:
                continue
            dest = rank(c - 1)
            g_of[c - 1, j] = slot = g_slots[dest].take()
            row["b_loc" if dest == r else ("g_below" if dest == r + 1 else "g_above")][dest] = slot
        rows.append(row)
        u += 1
    sizes = [max(b.size for b in slots) + 1 for slots in (a_slots, g_slots, r_slots, w_slots)]  # + dump
    table = {f: np.asarray([row[f] for row in rows], np.int32) for f in _FIELDS}
    for f, size in (("f_loc", sizes[0]), ("a_below", sizes[0]), ("a_above", sizes[0]), ("b_loc", sizes[1]),
                    ("g_below", sizes[1]), ("g_above", sizes[1]), ("f_res", sizes[2]), ("b_w", sizes[3])):
        table[f] = np.where(table[f] < 0, size - 1, table[f])  # writes to nowhere go to the dump slot
    kinds = 3 if backward else 1
    return Table(table, len(rows), *sizes, busy=busy / (kinds * s * len(rows)))


def apply(layer_fn: stages.LayerFn, stacked, x_MxB_: jax.Array, side_M_=None, *, mesh, stored_specs=None,
          split: bool = False):
    """`pipeline.pipeline_apply` under DualPipeV: (y [M, ...], aux [L, M, ...]); the forward runs the
    forward-only table, the backward (a custom_vjp) the full one. Side inputs get no gradient. x, y
    and their gradients are split over `pipeline` on the microbatch dimension when `split`
    (`stage_batch.StageBatch`)."""
    s, m = mesh.shape[AXIS], x_MxB_.shape[0]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    index, valid = v_layer_slots(num_layers, s)
    params = v_layout(stacked, mesh=mesh, stored_specs=stored_specs)
    run = functools.partial(_run, layer_fn, valid=valid, mesh=mesh, split=split)
    forward = functools.partial(run, schedule_table(s, m, backward=False))
    out, aux = stages.hand_run(forward, functools.partial(run, schedule_table(s, m)))(params, x_MxB_, side_M_)
    return out, jax.tree.map(lambda a: a[stages.slot_of_layer(index, valid)], aux)


def _ends(table: Table) -> dict:
    """Per unit, the microbatch (0 when none) and whether rank 0 reads x (chunk 0's F), reads ct_y
    (chunk 2S-1's B), writes the stack's output (chunk 2S-1's F) and its input gradient (chunk 0's
    B): the only steps that touch the stack's whole-batch arrays, all on rank 0 (the V's two ends)."""
    t = {f: a[:, 0] for f, a in table.rows.items()}
    ends = {"x": (t["f_on"] > 0) & (t["f_in"] < 0), "ct": (t["b_on"] > 0) & (t["b_in"] < 0),
            "y": (t["f_on"] > 0) & (t["f_v"] == 1), "dx": (t["b_on"] > 0) & (t["b_v"] == 0)}
    out = {}
    for name, on in ends.items():
        micro = t["b_m"] if name in ("ct", "dx") else t["f_m"]
        out[name + "_on"], out[name + "_m"] = jnp.asarray(on), jnp.asarray(np.where(on, micro, 0), np.int32)
    return out


def _run(layer_fn, table: Table, params, xs, side, ct_y=None, ct_aux=None, *, valid, mesh, split: bool = False):
    """The table's program. Forward-only (ct_y None): (y [M, ...], aux slots [S * 2K, M, ...]);
    otherwise (slot param grads, x grads [M, ...]). x, ct_y, y and the x gradient are
    `stage_batch.StageBatch`es: each unit reads x and ct_y for rank 0 and stores rank 0's y or input
    gradient, one microbatch each (`_ends`)."""
    s, m = mesh.shape[AXIS], xs.shape[0]
    backward = ct_y is not None
    param_specs = stages.stage_specs(params)
    rows = {f: jnp.asarray(a) for f, a in table.rows.items()}
    batch = StageBatch(split, m, s)

    def body(local_params, local_valid, xs, side, ct_y, ct_aux):
        stage = jax.lax.axis_index(AXIS)
        by_chunk = jax.tree.map(lambda a: a.reshape(2, -1, *a.shape[1:]), (local_params, local_valid))
        chunk = lambda v: jax.tree.map(lambda a: a[v], by_chunk)  # noqa: E731
        side_of = lambda i: jax.tree.map(lambda a: a[i], side)  # noqa: E731
        zero = jnp.zeros_like(xs[0])
        buffer = lambda n: jnp.zeros((n, *xs.shape[1:]), xs.dtype)  # noqa: E731
        put = jax.lax.dynamic_update_index_in_dim

        chunk_vjp = stages.ChunkVjp(layer_fn)

        def vjp_of(stash, slot, v):
            return chunk_vjp.vjp(chunk(v)[0], [b[slot] for b in stash])

        def cot_aux(v, j):  # this chunk's aux cotangents for microbatch j: [K, ...] each
            return [a.reshape(2, -1, *a.shape[1:])[v][:, j] for a in ct_aux]

        if backward:
            _, res_shapes = jax.eval_shape(chunk_vjp.forward, *chunk(0), xs[0], side_of(0))
            stash0 = [jnp.zeros((table.stash, *r.shape), r.dtype) for r in res_shapes]
            extra0 = (stash0, buffer(table.wait_w), stages.grad_accumulator(by_chunk[0]))
        else:
            _, aux_shapes = jax.eval_shape(functools.partial(stages.run_chunk, layer_fn), *chunk(0), xs[0], side_of(0))
            extra0 = jax.tree.map(lambda a: jnp.zeros((2, m, *a.shape), a.dtype), aux_shapes)

        def unit(carry, row_u):
            (inbox_a, inbox_g, ends, extra), (row_u, e) = carry, row_u
            r = {f: a[stage] for f, a in row_u.items()}
            x_in = batch.read(xs, e["x_m"])  # rank 0's input of chunk 0 (psums: every rank, every unit)
            if backward:
                ct_in = batch.read(ct_y, e["ct_m"])  # rank 0's cotangent of chunk 2S - 1

                def do_w(extra):
                    stash, wait, acc = extra
                    dp, _ = vjp_of(stash, r["w_res"], r["w_v"])((wait[r["w_slot"]], cot_aux(r["w_v"], r["w_m"])))
                    acc = jax.tree.map(lambda g, d: put(g, g[r["w_v"]] + d.astype(g.dtype), r["w_v"], 0), acc, dp)
                    return stash, wait, acc

                def do_b(extra):
                    stash, wait, acc = extra
                    g = jnp.where(r["b_in"] < 0, ct_in, inbox_g[jnp.maximum(r["b_in"], 0)])
                    _, dh = vjp_of(stash, r["b_res"], r["b_v"])((g, cot_aux(r["b_v"], r["b_m"])))
                    return (stash, put(wait, g, r["b_w"], 0), acc), dh

                def do_f(extra):
                    stash, wait, acc = extra
                    h = jnp.where(r["f_in"] < 0, x_in, inbox_a[jnp.maximum(r["f_in"], 0)])
                    y, res = chunk_vjp.forward(*chunk(r["f_v"]), h, side_of(r["f_m"]))
                    stash = [put(b, x, r["f_res"], 0) for b, x in zip(stash, res)]
                    return (stash, wait, acc), y

                extra = jax.lax.cond(r["w_on"] > 0, do_w, lambda e: e, extra)
                extra, dh = jax.lax.cond(r["b_on"] > 0, do_b, lambda e: (e, zero), extra)
                ends = batch.write(ends, dh, e["dx_m"], e["dx_on"], src=0)  # chunk 0: the input gradient
            else:
                def do_f(aux):
                    h = jnp.where(r["f_in"] < 0, x_in, inbox_a[jnp.maximum(r["f_in"], 0)])
                    y, a = stages.run_chunk(layer_fn, *chunk(r["f_v"]), h, side_of(r["f_m"]))
                    return jax.tree.map(lambda b, x: b.at[r["f_v"], r["f_m"]].set(x), aux, a), y

                dh = zero
            extra, y = jax.lax.cond(r["f_on"] > 0, do_f, lambda e: (e, zero), extra)
            if not backward:
                ends = batch.write(ends, y, e["y_m"], e["y_on"], src=0)  # chunk 2S - 1: the stack's output
            inbox_a = put(inbox_a, y, r["f_loc"], 0)
            inbox_g = put(inbox_g, dh, r["b_loc"], 0)
            up, down = [(i, i + 1) for i in range(s - 1)], [(i + 1, i) for i in range(s - 1)]
            inbox_a = put(inbox_a, jax.lax.ppermute(y, AXIS, up), r["a_below"], 0)
            inbox_a = put(inbox_a, jax.lax.ppermute(y, AXIS, down), r["a_above"], 0)
            inbox_g = put(inbox_g, jax.lax.ppermute(dh, AXIS, up), r["g_below"], 0)
            inbox_g = put(inbox_g, jax.lax.ppermute(dh, AXIS, down), r["g_above"], 0)
            return (inbox_a, inbox_g, ends, extra), None

        # ends: the input gradient (backward) or the output (forward), [M or M / S, ...]
        init = (buffer(table.inbox_a), buffer(table.inbox_g), jnp.zeros_like(xs), extra0)
        (_, _, ends, extra), _ = jax.lax.scan(unit, init, (rows, _ends(table)))
        if backward:
            _, _, acc = extra
            grads = jax.tree.map(lambda g, p: g.reshape(p.shape).astype(p.dtype), acc, local_params)
            return grads, batch.result(ends, src=0)
        aux = jax.tree.map(lambda a: jnp.swapaxes(a, 1, 2).reshape(-1, m, *a.shape[3:]), extra)  # [2K, M, ...]
        return batch.result(ends, src=0), aux

    if backward:
        out_specs = (param_specs, batch.spec())
        in_specs = (param_specs, P(AXIS), batch.spec(), P(), batch.spec(), [P(AXIS)] * len(ct_aux))
    else:
        out_specs, in_specs = (batch.spec(), P(AXIS)), (param_specs, P(AXIS), batch.spec(), P(), P(), P())
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS},
                         check_vma=False)(params, jnp.asarray(valid), xs, side, ct_y, ct_aux)

"""What every pipeline schedule shares (sharding/pipeline.py's GPipe, circular and 1F1B,
sharding/dualpipev.py's V): the layer function's type, how many layers each stage holds, which
layer each stage-major slot runs, the move of a stored stack into those slots, one chunk of slots
run in a scan, and the custom_vjp and residual stash of the schedules whose backward runs by hand."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# (one layer's params, x [microbatch...], one microbatch's side inputs) -> (x, per-layer aux pytree)
LayerFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]
AXIS = "pipeline"  # the mesh axis the stages are split over


def stage_layers(num_layers: int, num_stages: int) -> list[int]:
    """Real layers on each stage: Q on the first L mod S stages, Q - 1 on the rest (Q on all if even)."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (i < extra) for i in range(num_stages)]


def chunk_slots(num_layers: int, chunks_of_stage: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(layer index, bool validity) of the stage-major slots when the stack is cut into C chunks of
    K = ceil(L / C) slots, balanced like `stage_layers`, and stage s holds chunks_of_stage[s] in
    that order. Padding slots point at layer 0."""
    chunks = sum(len(c) for c in chunks_of_stage)
    k = -(-num_layers // chunks)
    starts = np.cumsum([0] + stage_layers(num_layers, chunks))
    index, valid = [], []
    for c in (c for stage in chunks_of_stage for c in stage):
        count = starts[c + 1] - starts[c]
        index += [starts[c] + j if j < count else 0 for j in range(k)]
        valid += [j < count for j in range(k)]
    return np.asarray(index, np.int32), np.asarray(valid)


def slot_of_layer(index: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Slot position of each real layer: the inverse of `chunk_slots` on its valid slots."""
    return np.argsort(np.where(valid, index, len(index)), kind="stable")[:int(valid.sum())]


def stage_specs(tree) -> Any:
    """PartitionSpecs splitting every leaf of `tree` over the stages on its first (slot) dimension."""
    return jax.tree.map(lambda a: P(AXIS, *([None] * (a.ndim - 1))), tree)


def _axis_dim(spec, axis: str) -> int | None:
    """The dimension a PartitionSpec splits over mesh axis `axis`, or None."""
    for dim, entry in enumerate(spec):
        if entry == axis or (isinstance(entry, tuple) and axis in entry):
            return dim
    return None


def to_slots(stacked: Any, index: np.ndarray, stored_specs: Any, *, mesh) -> Any:
    """stacked[index] ([S * K, ...] slots, stage-major, split over `pipeline` on the slot dimension) for
    an [L, ...] stack stored with `stored_specs` (PartitionSpecs; the layer axis cannot take `pipeline`
    when S does not divide L, so a later dimension d holds it, rules.py). Each stage gathers the
    slots of every stage from its own d-slice (local) and one tiled all_to_all over `pipeline` swaps
    them: stage s ends with its K slots whole on d. No stage holds more than its slots' share of a
    weight; the plain gather `stacked[index]` leaves that to XLA's partitioner (on an even DualPipeV
    V it all-gathered the whole stack on every stage; docs/architecture.md, "Uneven splits"). A leaf
    not split over `pipeline` is replicated there: each stage takes its slots. A dimension split over
    `pipeline` beside other mesh axes is taken as split over `pipeline` first (XLA reshards it if the stored
    order differs). A stack whose layer axis is split over `pipeline` is gathered whole first (see the
    comment below). The backward is the transpose (all_to_all back, local scatter-add). Without
    `stored_specs` (None), the plain gather."""
    if stored_specs is None:  # the plain gather
        return jax.tree.map(lambda a: a[index], stacked)
    s = mesh.shape[AXIS]
    table_SxK = jnp.asarray(np.asarray(index).reshape(s, -1))
    leaves, treedef = jax.tree.flatten(stacked)
    specs = jax.tree.leaves(stored_specs, is_leaf=lambda x: isinstance(x, P))  # one per leaf, in order
    if len(specs) != len(leaves):
        raise ValueError(f"stored_specs holds {len(specs)} PartitionSpecs for a stack of {len(leaves)} arrays")
    # A layer axis split over `pipeline` (S divides L but the schedule's slots are not the stored
    # layout: DualPipeV's V when 2S does not) is taken whole, as a leaf not split over `pipeline`:
    # the all_to_all below would index a stage's own layers by global layer numbers.
    dim_of = [None if d == 0 else d for d in (_axis_dim(spec, AXIS) for spec in specs)]

    def body(*local):
        stage = jax.lax.axis_index(AXIS)
        out = []
        for a, d in zip(local, dim_of):
            if d is None:
                out.append(jnp.take(a, table_SxK[stage], axis=0))
            else:
                out.append(jax.lax.all_to_all(a[index], AXIS, 0, d, tiled=True))
        return tuple(out)

    moved = jax.shard_map(body, mesh=mesh, in_specs=tuple(P() if d is None else P(*([None] * d), AXIS) for d in dim_of),
                          out_specs=tuple(P(AXIS) for _ in leaves), axis_names={AXIS}, check_vma=False)(*leaves)
    return jax.tree.unflatten(treedef, moved)


def run_chunk(layer_fn: LayerFn, chunk_params, chunk_valid, x, side):
    """x through the K slots of one chunk (padding slots pass x on): (y, aux [K, ...])."""
    def body(h, layer):
        p, ok = layer
        y, aux = layer_fn(p, h, side)
        return jnp.where(ok, y, h), aux

    return jax.lax.scan(body, x, (chunk_params, chunk_valid))


def zero_cotangent(x):
    """A zero cotangent for `x` (float0 for integer arrays)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def hand_run(forward: Callable, backward: Callable) -> Callable:
    """`f(slot params, x, side) -> (y, aux)` as a custom_vjp: `forward(params, x, side)` keeps only
    its inputs, `backward(params, x, side, ct_y, ct_aux leaves)` gives (param grads, x grads); side
    inputs get no gradient, and integer aux outputs no cotangent."""

    @jax.custom_vjp
    def run(params, xs, side):
        return forward(params, xs, side)

    def fwd(params, xs, side):
        return run(params, xs, side), (params, xs, side)

    def bwd(res, ct):
        params, xs, side = res
        ct_y, ct_aux = ct
        ct_aux = [a for a in jax.tree.leaves(ct_aux) if a.dtype != jax.dtypes.float0]
        grads, dxs = backward(params, xs, side, ct_y, ct_aux)
        return grads, dxs, jax.tree.map(zero_cotangent, side)

    run.defvjp(fwd, bwd)
    return run


class ChunkVjp:
    """A chunk's `jax.vjp`, split so that a hand-run backward can stash it between a forward and its
    backward: `forward` returns y and the residuals less the parameters (found by identity: they
    are read again rather than stored), `vjp` rebuilds the vjp function from both."""

    def __init__(self, layer_fn: LayerFn):
        self.layer_fn = layer_fn

    def forward(self, p, ok, h, side) -> tuple[jax.Array, list]:
        def f(p_, h_):
            y, aux = run_chunk(self.layer_fn, p_, ok, h_, side)
            return y, [a for a in jax.tree.leaves(aux) if jnp.issubdtype(a.dtype, jnp.inexact)]  # those with a gradient

        out, vjp_fn = jax.vjp(f, p, h)
        leaves, self.treedef = jax.tree.flatten(vjp_fn)
        self.owners = [next((i for i, q in enumerate(jax.tree.leaves(p)) if leaf is q), -1) for leaf in leaves]
        return out[0], [leaf for leaf, i in zip(leaves, self.owners) if i < 0]

    def vjp(self, p, saved: list) -> Callable:
        saved, param_leaves = iter(saved), jax.tree.leaves(p)
        return jax.tree.unflatten(self.treedef, [param_leaves[i] if i >= 0 else next(saved) for i in self.owners])


def grad_accumulator(params) -> Any:
    """Zero weight gradients of `params`' shapes, accumulated in at least fp32."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), params)

"""Expert-parallel dispatch on 8 fake CPU devices against the single-device dispatch (JSON lines).

    python -m tests.sharding.ep_worker

For meshes expert=8 and data=2 x expert=4, routings uniform and all-to-one-device, and both
exchanges: outputs and gradients against the dense single-device dispatch; the rows the local
grouped matmul computes, counted at run time by a callback in each executed row tile; with a
capacity factor, the dropped pairs and the output against a numpy model of the rule. Then the
MoE FLOPs per device with and without tensor ranks (tests/sharding/ep_tensor_worker.py).
"""

import json
import os

from tests.helpers import fake_device_flags

os.environ.setdefault("XLA_FLAGS", fake_device_flags(8, fast_compile=True))

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sharding  # noqa: E402
from sharding import expert_parallel  # noqa: E402
from dsv3_jax.ops import dispatch, tile_loop  # noqa: E402
from tests.sharding import ep_tensor_worker  # noqa: E402

N, D, F, E, K = 64, 16, 8, 32, 4
TILE = 8  # max_tile of the local grouped matmul
SHARDS = 8  # token blocks: every device holds N / 8 tokens on both meshes
MESHES = {"expert8": {"expert": 8}, "data2_expert4": {"data": 2, "expert": 4}}
ROWS_COMPUTED = [0]  # rows through _tile_swiglu, counted on the host as tiles execute


def _counting_tile_swiglu(tile_swiglu):
    def counted(x_txD, *w):
        jax.debug.callback(lambda: ROWS_COMPUTED.__setitem__(0, ROWS_COMPUTED[0] + x_txD.shape[0]))
        return tile_swiglu(x_txD, *w)

    return counted


def inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D)).astype(np.float32)
    weights = rng.random((N, K)).astype(np.float32)
    w = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, weights, w


def routing(kind: str, p: int) -> np.ndarray:
    """[N, K] distinct experts per token: uniform over E, or all among device 0's E/P experts."""
    rng = np.random.default_rng(1)
    pool = E if kind == "uniform" else E // p
    return np.stack([rng.choice(pool, K, replace=False) for _ in range(N)]).astype(np.int32)


def kept_pairs(experts, p, cf):
    """numpy model of the capacity rule: per source device (token block) and destination, rows past
    the capacity, in flattened (token, slot) order, are dropped. Returns bool [N, K]."""
    n_local = N // SHARDS
    cap = expert_parallel.capacity(n_local * K, p, cf)
    keep = np.ones((N, K), bool)
    for s in range(SHARDS):
        dest = experts[s * n_local:(s + 1) * n_local].reshape(-1) // (E // p)
        flat_keep = np.ones(dest.size, bool)
        for dev in range(p):
            flat_keep[np.nonzero(dest == dev)[0][cap:]] = False
        keep[s * n_local:(s + 1) * n_local] = flat_keep.reshape(n_local, K)
    return keep


def expected_rows(experts, keep, p, cf):
    """Theoretical rows of the receive-side tiled matmul over all devices: per exchange group (the
    devices of one data index) and expert, its received rows rounded up to the tile."""
    n_local = N // SHARDS
    received = p * expert_parallel.capacity(n_local * K, p, cf)  # the static receive buffer
    t = tile_loop.tile_rows(received, E // p, TILE)
    group_tokens = N // (SHARDS // p)
    total = 0
    for g in range(SHARDS // p):
        sl = slice(g * group_tokens, (g + 1) * group_tokens)
        counts = np.bincount(experts[sl][keep[sl]], minlength=E)
        total += int(np.sum(-(-counts // t) * t))
    return total, t


def main():
    tile_loop._tile_swiglu = _counting_tile_swiglu(tile_loop._tile_swiglu)
    x, weights, w = inputs()
    local = functools.partial(dispatch.local_expert_mlp, impl="tiled", max_tile=TILE)

    def ref(x, experts, weights, w):
        return dispatch.routed_experts(x, experts, weights, *w, impl="dense")

    def loss(f):
        return lambda x, experts, weights, w: jnp.sum(jnp.sin(f(x, experts, weights, w)))

    grad = functools.partial(jax.grad, argnums=(0, 2, 3))
    ref_jit, ref_grad = jax.jit(ref), jax.jit(grad(loss(ref)))
    for mesh_name, sizes in MESHES.items():
        mesh, p = sharding.make_mesh(sizes), sizes["expert"]
        for exchange in ("padded", "ragged"):
            def ep(x, experts, weights, w, cf, mesh=mesh, exchange=exchange):
                return expert_parallel.expert_parallel(x, experts, weights, w, local, mesh=mesh, num_experts=E,
                                                       capacity_factor=cf, exchange=exchange)

            dropless = jax.jit(functools.partial(ep, cf=None))
            dropless_grad = jax.jit(grad(loss(lambda *a: ep(*a, cf=None)[0])))
            capped = jax.jit(functools.partial(ep, cf=1.0))
            for kind in ("uniform", "one_device"):
                experts = routing(kind, p)
                ROWS_COMPUTED[0] = 0
                y, dropped = dropless(x, experts, weights, w)
                jax.effects_barrier()
                rows = ROWS_COMPUTED[0]
                y_ref = np.asarray(ref_jit(x, experts, weights, w))
                g = dropless_grad(x, experts, weights, w)
                g_ref = ref_grad(x, experts, weights, w)
                grad_rel = max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
                               for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)))
                expected, t = expected_rows(experts, np.ones((N, K), bool), p, None)
                record = {"mesh": mesh_name, "exchange": exchange, "routing": kind, "p": p, "tile": t,
                          "rows_computed": rows, "rows_expected": expected, "routed_rows": N * K,
                          "dropped": int(dropped), "out_rel": float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)),
                          "grad_rel": grad_rel}
                if kind == "one_device":  # the skewed case overflows a capacity of 1.0
                    keep = kept_pairs(experts, p, 1.0)
                    ROWS_COMPUTED[0] = 0
                    y_cap, dropped_cap = capped(x, experts, weights, w)
                    jax.effects_barrier()
                    y_drop = np.asarray(ref_jit(x, experts, weights * keep, w))
                    record.update(cf=1.0, cf_dropped=int(dropped_cap), cf_dropped_ref=int((~keep).sum()),
                                  cf_out_rel=float(np.linalg.norm(y_cap - y_drop) / np.linalg.norm(y_drop)),
                                  cf_rows_computed=ROWS_COMPUTED[0],
                                  cf_rows_expected=expected_rows(experts, keep, p, 1.0)[0])
                print(json.dumps(record), flush=True)
    lowerings()
    ep_tensor_worker.flops_rows()


def lowerings():
    """`auto` follows the platform lowered for: TPU and CUDA get ragged_all_to_all and ragged_dot
    (forward and backward), CPU the padded all_to_all and the tiled loop, all from this CPU host."""
    x, weights, w = inputs()
    sizes = MESHES["data2_expert4"]
    abstract = sharding.abstract_mesh(sizes, 8)
    tokens = jax.sharding.NamedSharding(abstract, jax.sharding.PartitionSpec(("data", "expert"), None))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=tokens) for a in (x, weights)]
    args.append([jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(
        abstract, jax.sharding.PartitionSpec("expert"))) for a in w])
    experts = jnp.asarray(routing("uniform", 4))
    local = functools.partial(dispatch.local_expert_mlp, impl="auto", max_tile=TILE)

    def loss(x, weights, w):
        y, _ = expert_parallel.expert_parallel(x, experts, weights, w, local, mesh=abstract, num_experts=E)
        return jnp.sum(jnp.sin(y))

    for platform in ("tpu", "cuda", "cpu"):
        with jax.sharding.use_abstract_mesh(abstract):
            text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(
                lowering_platforms=(platform,)).as_text()
        print(json.dumps({"lowered": platform, "ragged_all_to_all_ops": text.count("ragged_all_to_all"),
                          "all_to_all_ops": text.count("all_to_all") - text.count("ragged_all_to_all"),
                          "ragged_dot_ops": text.count("ragged_dot")}), flush=True)


if __name__ == "__main__":
    main()

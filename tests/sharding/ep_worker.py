"""Expert-parallel dispatch on 8 fake CPU devices against the single-device dispatch (JSON lines).

    python -m tests.sharding.ep_worker
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
from dsv3_jax.ops import dispatch  # noqa: E402

N, D, F, E, K = 64, 16, 8, 16, 4
MESH = {"data": 2, "expert": 4}


def inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D)).astype(np.float32)
    # distinct experts per token, skewed towards the first device's experts
    experts = np.stack([rng.choice(E, K, replace=False, p=np.r_[np.full(4, 0.15), np.full(12, 0.4 / 12)])
                        for _ in range(N)]).astype(np.int32)
    weights = rng.random((N, K)).astype(np.float32)
    w = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, experts, weights, w


def dropped_reference(x, experts, weights, w, cf):
    """numpy: per source device (8 token blocks) and destination, rows past the capacity are dropped."""
    p, shards = 4, 8
    n_local = N // shards
    m = n_local * K
    cap = expert_parallel.capacity(m, p, cf)
    keep = np.ones((N, K), bool)
    for s in range(shards):
        block = experts[s * n_local:(s + 1) * n_local].reshape(-1)
        dest = block // (E // p)
        for dev in range(p):
            rows = np.nonzero(dest == dev)[0]  # stable: flattened (token, slot) order
            flat_keep = keep[s * n_local:(s + 1) * n_local].reshape(-1)
            flat_keep[rows[cap:]] = False
            keep[s * n_local:(s + 1) * n_local] = flat_keep.reshape(n_local, K)
    y = dispatch.routed_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights * keep), *w, impl="dense")
    return np.asarray(y), int((~keep).sum())


def main():
    x, experts_np, weights, w = inputs()
    experts = jnp.asarray(experts_np)
    mesh = sharding.make_mesh(MESH)
    local = functools.partial(dispatch.local_expert_mlp, impl="tiled", max_tile=8)
    # XLA:CPU cannot run ragged-all-to-all: the ragged exchange runs with the all_gather emulation.
    exchanges = {"padded": {"exchange": "padded"},
                 "ragged": {"exchange": "ragged", "ragged_all_to_all": expert_parallel.ragged_all_to_all_by_gather}}

    def ref(x, weights, w):
        return dispatch.routed_experts(x, experts, weights, *w, impl="dense")

    def loss(f):
        return lambda x, weights, w: jnp.sum(jnp.sin(f(x, weights, w)))

    y_ref = np.asarray(jax.jit(ref)(x, weights, w))
    g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(x, weights, w)
    for name, kw in exchanges.items():
        def ep(x, weights, w, cf, mesh=mesh, kw=kw):
            return expert_parallel.expert_parallel(x, experts, weights, w, local, mesh=mesh, num_experts=E,
                                                   capacity_factor=cf, **kw)

        hlo = jax.jit(functools.partial(ep, cf=None)).lower(x, weights, w).compile().as_text()
        print(json.dumps({"exchange": name, "all_to_all_ops": hlo.count("all-to-all("),
                          "all_gather_ops": hlo.count("all-gather(")}), flush=True)
        for cf in (None, 4.0):
            y = np.asarray(jax.jit(functools.partial(ep, cf=cf))(x, weights, w))
            g = jax.jit(jax.grad(loss(functools.partial(ep, cf=cf)), argnums=(0, 1, 2)))(x, weights, w)
            grad_rel = max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
                           for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)))
            print(json.dumps({"exchange": name, "cf": cf,
                              "out_rel": float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)),
                              "grad_rel": grad_rel}), flush=True)
        for cf in (0.5, 1.0):
            y = np.asarray(jax.jit(functools.partial(ep, cf=cf))(x, weights, w))
            y_drop, dropped = dropped_reference(x, experts_np, weights, w, cf)
            print(json.dumps({"exchange": name, "cf": cf, "dropped": dropped,
                              "out_rel": float(np.linalg.norm(y - y_drop) / np.linalg.norm(y_drop)),
                              "differs_from_dropless": float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))}),
                  flush=True)
    # The real collective: the ragged exchange (forward and backward) lowers for TPU and CUDA.
    abstract = sharding.abstract_mesh(MESH, 8)
    tokens = jax.sharding.NamedSharding(abstract, jax.sharding.PartitionSpec(("data", "expert"), None))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=tokens) for a in (x, weights)]
    args.append([jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(
        abstract, jax.sharding.PartitionSpec("expert"))) for a in w])

    def real(x, weights, w):
        return expert_parallel.expert_parallel(x, jnp.zeros(experts.shape, jnp.int32), weights, w, local,
                                               mesh=abstract, num_experts=E, exchange="ragged")

    for platform in ("tpu", "cuda"):
        with jax.sharding.use_abstract_mesh(abstract):
            text = jax.jit(jax.grad(loss(real), argnums=(0, 1, 2))).trace(*args).lower(
                lowering_platforms=(platform,)).as_text()
        print(json.dumps({"lowered": platform, "ragged_all_to_all_ops": text.count("ragged_all_to_all")}),
              flush=True)


if __name__ == "__main__":
    main()

"""Dispatch cost follows activated experts, not total: MoE forward time at 8 vs 64 experts.

Same tokens, same top-k, same expert size; only the number of experts changes. Each impl is timed
side by side in one run (the machine is shared and noisy), median of several repeats:

    python -m experiments.bench_moe_dispatch [--tokens 4096 --top_k 2 --dim 256 --hidden 128]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.ops import dispatch


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, nargs=2, default=(8, 64))
    p.add_argument("--impls", nargs="+", default=["tiled", "ragged", "dense"])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"backend={jax.default_backend()} tokens={args.tokens} top_k={args.top_k} D={args.dim} F={args.hidden}")
    rows = {}
    for e in args.experts:
        ks = jax.random.split(jax.random.key(e), 5)
        x = jax.random.normal(ks[0], (args.tokens, args.dim), jnp.float32)
        experts = jnp.argsort(jax.random.uniform(ks[1], (args.tokens, e)), axis=1)[:, : args.top_k].astype(jnp.int32)
        weights = jnp.full((args.tokens, args.top_k), 1.0 / args.top_k)
        w1 = jax.random.normal(ks[2], (e, args.dim, args.hidden)) * 0.05
        w3 = jax.random.normal(ks[3], (e, args.dim, args.hidden)) * 0.05
        w2 = jax.random.normal(ks[4], (e, args.hidden, args.dim)) * 0.05
        for impl in args.impls:
            fn = jax.jit(lambda *a, impl=impl: dispatch.routed_experts(*a, impl=impl))
            rows[(impl, e)] = _time(fn, x, experts, weights, w1, w3, w2, repeats=args.repeats)
    lo, hi = args.experts
    print(f"{'impl':8s} {f'{lo} experts':>12s} {f'{hi} experts':>12s} {'ratio':>7s}")
    for impl in args.impls:
        a, b = rows[(impl, lo)], rows[(impl, hi)]
        print(f"{impl:8s} {a * 1e3:10.1f}ms {b * 1e3:10.1f}ms {b / a:7.2f}")


if __name__ == "__main__":
    main()

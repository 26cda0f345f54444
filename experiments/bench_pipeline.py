"""Pipeline bubble, measured against theory: GPipe step time for M microbatches on S stages.

The bubble is the share of a step that does no useful work. Step times t(M) for several M are
fitted as t(M) = a * M + b: a is the cost of one more microbatch (one tick of every stage), b the
cost that does not shrink with M. Theory says b = (S - 1) / R * a (the S - 1 fill/drain ticks,
each 1 / R of a microbatch's work when the stack goes round the ring R times: `--rounds`, the
circular schedule), so the fit's b / a is checked against (S - 1) / R, and each M's bubble is

    measured = 1 - a * M / t(M)        theory = (S - 1) / (R * M + S - 1)

All runs happen side by side in one process (the machine is shared and noisy), median of several
repeats. Stages are fake CPU devices here, which share the host's cores; that scales a and b
alike, so the ratios hold even though absolute times are not those of real chips. "counted" is
the idle share of stage-ticks that the schedule itself counts as it runs.

    python -m experiments.bench_pipeline [--stages 4 --layers 8 --microbatches 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--layers", type=int, default=8, help="layers of the stack (need not divide by --stages)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--rows", type=int, default=256, help="rows per microbatch")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=1, help="1: GPipe; R > 1: circular schedule (needs M >= S)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per M (median)")
    return p.parse_args()


def main() -> None:
    args = _parse()
    if "jax" not in sys.modules:  # fake one CPU device per stage unless the host has enough devices
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.stages}")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import sharding
    from sharding import pipeline

    def layer(p, x, side):
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"], None

    def timed(fn, *a) -> float:
        jax.block_until_ready(fn(*a))  # compile
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    s = args.stages
    mesh = sharding.make_mesh({"pipeline": s}, devices=jax.devices()[:s])
    rng = np.random.default_rng(0)
    stacked = {"w1": jnp.asarray(rng.standard_normal((args.layers, args.dim, args.hidden)) / args.dim ** 0.5,
                                 jnp.float32),
               "w2": jnp.asarray(rng.standard_normal((args.layers, args.hidden, args.dim)) / args.hidden ** 0.5,
                                 jnp.float32)}
    print(f"{s} stages x {args.rounds} round(s), {args.layers} layers "
          f"({pipeline.stage_layers(args.layers, s * args.rounds)} per chunk), "
          f"{args.rows} rows x {args.dim} per microbatch, median of {args.repeats}", flush=True)
    r = args.rounds
    step = jax.jit(lambda st, x: pipeline.pipeline_apply(layer, st, x, mesh=mesh, repeats=r, return_activity=True))
    micro = [m for m in args.microbatches if r == 1 or m >= s]
    times, counted = [], []
    for m in micro:
        xs = jnp.asarray(rng.standard_normal((m, args.rows, args.dim)), jnp.float32)
        times.append(timed(step, stacked, xs))
        counted.append(1.0 - float(step(stacked, xs)[2]))
    ms = np.asarray(micro, np.float64)
    a, b = np.polyfit(ms, times, 1)
    fit = a * ms + b
    r2 = 1 - np.sum((np.asarray(times) - fit) ** 2) / np.sum((np.asarray(times) - np.mean(times)) ** 2)
    print(f"fit t(M) = {a * 1e3:.2f} ms * M + {b * 1e3:.2f} ms (R^2 {r2:.4f}); "
          f"b / a = {b / a:.2f} microbatches, theory (S - 1) / R = {(s - 1) / r:.2f}", flush=True)
    print(f"{'M':>4} {'ticks':>6} {'step ms':>9} {'bubble measured':>16} {'theory':>7} {'counted':>8}")
    for m, t, c in zip(micro, times, counted):
        print(f"{m:>4} {r * m + s - 1:>6} {t * 1e3:>9.1f} {1 - a * m / t:>16.3f} "
              f"{pipeline.bubble_fraction(s, m, r):>7.3f} {c:>8.3f}", flush=True)


if __name__ == "__main__":
    main()

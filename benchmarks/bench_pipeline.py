"""Pipeline schedules measured against theory: peak temporary memory and step time of a training
step (forward and backward) for M microbatches on S stages, GPipe beside 1F1B and DualPipeV.

Memory: the compiled step's `memory_analysis().temp_size_in_bytes` per device for each M at a fixed
microbatch size. GPipe keeps every microbatch's residuals until its backward starts, so its
temporaries grow by one microbatch's residuals per M; 1F1B (sharding/pipeline.py) keeps at most S,
and DualPipeV (sharding/dualpipev.py) at most 2S + 1 half-stage chunks plus the deferred weight
gradients, so theirs grow only by [M, rows, dim] buffers (the stack's input, output and their
cotangents; "x one microbatch's stack input" below).

Time: step times t(M) are fitted as t(M) = a * M + b: a is the cost of one more microbatch, b the
cost that does not shrink with M. Both schedules idle S - 1 of every M + S - 1 stage-ticks (GPipe:
the fill and drain of its forward and of its backward; 1F1B: 2 (S - 1) of 2 (M + S - 1) units), so
theory says b / a = S - 1 (the circular schedule, `--schedules=circular --rounds R`: (S - 1) / R,
bubble (S - 1) / (R M + S - 1)) and the bubble is

    measured = 1 - a * M / t(M)        theory = (S - 1) / (M + S - 1)

DualPipeV's theory column is its table's own count: the idle share of the forward table's F slots
and the backward table's F, B and W slots (sharding/dualpipev.py:schedule_table), each slot a
half-stage chunk; its b / a theory is that of the units (U(M) = a' M + b': b' / a').

All runs happen side by side in one process (the machine is shared and noisy): every (schedule, M)
is compiled first, then timed in rounds that alternate them, median over the rounds. Stages are
fake CPU devices here, which share the host's cores; that scales a and b alike, so the ratios hold
even though absolute times are not those of real chips.

    python -m benchmarks.bench_pipeline [--stages 4 --layers 8 --microbatches 1,2,4,8,16]

Each fake device should run on one core of its own, or an idle stage's core is used by another
stage's intra-op threads and the bubble does not show as time; on a 2-core host:

    XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false" \
        python -m benchmarks.bench_pipeline --stages 2
"""

from __future__ import annotations

import os
import sys
import time

from absl import flags

from dsv3_jax import cli


SCHEDULES = ("gpipe", "circular", "1f1b", "dualpipev")


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("stages", 4, "pipeline stages S (fake CPU devices)", flag_values=fv)
    flags.DEFINE_integer("layers", 8, "layers of the stack (need not divide by --stages)", flag_values=fv)
    flags.DEFINE_list("microbatches", "4,8,16,32", "microbatch counts M, comma-separated", flag_values=fv)
    flags.DEFINE_list("schedules", "gpipe,1f1b,dualpipev",
                      f"schedules to time, comma-separated, of {','.join(SCHEDULES)}", flag_values=fv)
    flags.DEFINE_integer("rounds", 2, "rounds R of the circular schedule (needs M >= S)", flag_values=fv)
    flags.DEFINE_integer("rows", 64, "rows per microbatch", flag_values=fv)
    flags.DEFINE_integer("dim", 128, "model dimension", flag_values=fv)
    flags.DEFINE_integer("hidden", 1024, "hidden size of each layer's MLP", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "timed runs per M (median)", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.numbers(args, "microbatches")
    if set(args.schedules) - set(SCHEDULES):
        cli.usage(f"--schedules={','.join(args.schedules)}: expected some of {','.join(SCHEDULES)}")
    if "jax" not in sys.modules:  # fake one CPU device per stage unless the host has enough devices
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.stages}")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import sharding
    from sharding import dualpipev, pipeline

    def theory(schedule, m):
        if schedule != "dualpipev":
            return pipeline.bubble_fraction(s, m, args.rounds if schedule == "circular" else 1)
        f, b = dualpipev.schedule_table(s, m, backward=False), dualpipev.schedule_table(s, m)
        return 1 - (f.busy * f.units + 3 * b.busy * b.units) / (f.units + 3 * b.units)

    def theory_ratio(schedule):
        if schedule != "dualpipev":
            return (s - 1) / (args.rounds if schedule == "circular" else 1)
        units = [dualpipev.schedule_table(s, m, backward=False).units + dualpipev.schedule_table(s, m).units
                 for m in args.microbatches]
        a_u, b_u = np.polyfit(ms, units, 1)
        return b_u / a_u

    def layer(p, x, side):
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"], None

    s = args.stages
    mesh = sharding.make_mesh({"pipeline": s}, devices=jax.devices()[:s])
    rng = np.random.default_rng(0)
    stacked = {"w1": jnp.asarray(rng.standard_normal((args.layers, args.dim, args.hidden)) / args.dim ** 0.5,
                                 jnp.float32),
               "w2": jnp.asarray(rng.standard_normal((args.layers, args.hidden, args.dim)) / args.hidden ** 0.5,
                                 jnp.float32)}
    boundary = args.rows * args.dim * 4 / 2 ** 20
    print(f"{s} stages, {args.layers} layers ({pipeline.stage_layers(args.layers, s)} per stage), "
          f"{args.rows} rows x {args.dim} (hidden {args.hidden}) per microbatch, median of {args.repeats}; "
          f"one microbatch's stack input is {boundary:.3f} MiB", flush=True)

    def make_step(schedule):
        def loss(st, x):
            r = args.rounds if schedule == "circular" else 1
            y, _ = pipeline.pipeline_apply(layer, st, x, mesh=mesh, schedule=schedule, repeats=r)
            return jnp.sum(jnp.sin(y))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    ms = np.asarray(args.microbatches, np.float64)
    runs, temps = {}, {}  # (schedule, M) -> (compiled step, its inputs) / temporaries MiB
    for schedule in args.schedules:
        step = make_step(schedule)
        for m in args.microbatches:
            xs = jnp.asarray(rng.standard_normal((m, args.rows, args.dim)), jnp.float32)
            compiled = step.lower(stacked, xs).compile()
            temps[schedule, m] = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
            runs[schedule, m] = (compiled, xs)
            jax.block_until_ready(compiled(stacked, xs))  # warm
    # Timed in rounds: each round runs every (M, schedule) once, alternating, so that load on the
    # shared machine falls on all of them alike; the median over rounds is reported.
    times = {key: [] for key in runs}
    for _ in range(args.repeats):
        for m in args.microbatches:
            for schedule in args.schedules:
                compiled, xs = runs[schedule, m]
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(stacked, xs))
                times[schedule, m].append(time.perf_counter() - t0)
    print(f"{'schedule':>9} {'M':>4} {'temp MiB':>9} {'step ms':>9} {'bubble measured':>16} {'theory':>7}")
    for schedule in args.schedules:
        t = np.asarray([np.median(times[schedule, m]) for m in args.microbatches])
        mem = np.asarray([temps[schedule, m] for m in args.microbatches])
        a, b = np.polyfit(ms, t, 1)
        slope = np.polyfit(ms, mem, 1)[0]
        for m, mem_m, t_m in zip(args.microbatches, mem, t):
            print(f"{schedule:>9} {m:>4} {mem_m:>9.2f} {t_m * 1e3:>9.1f} {1 - a * m / t_m:>16.3f} "
                  f"{theory(schedule, m):>7.3f}", flush=True)
        formula = {"gpipe": "(S-1)/(M+S-1)", "1f1b": "(S-1)/(M+S-1)", "circular": "(S-1)/(R*M+S-1)",
                   "dualpipev": "the table's idle share"}[schedule]
        print(f"{schedule:>9} fit t(M) = {a * 1e3:.2f} ms * M + {b * 1e3:.2f} ms: b / a = {b / a:.2f} microbatches "
              f"(theory {theory_ratio(schedule):.2f}; bubble {formula}); temporaries grow {slope:.3f} MiB per "
              f"microbatch = {slope / boundary:.1f} x one microbatch's stack input", flush=True)
        # The fastest round of each M is the one other processes disturbed least (a shared host).
        a_min, b_min = np.polyfit(ms, [np.min(times[schedule, m]) for m in args.microbatches], 1)
        spread = np.median([np.ptp(times[schedule, m]) / np.median(times[schedule, m]) for m in args.microbatches])
        print(f"{schedule:>9} fit on the fastest rounds: b / a = {b_min / a_min:.2f}; rounds spread "
              f"{spread:.0%} of the median (max - min), the intercept b is {b / t[0]:.0%} of t(M={args.microbatches[0]})",
              flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())

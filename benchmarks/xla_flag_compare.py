"""The bench's train step compiled under several XLA:CPU option sets, timed side by side in one process.

    python -m benchmarks.xla_flag_compare --variant=bench --rounds=8 --sets=none,dot,idot,greedy

Separate processes per flag set (XLA_FLAGS) compare runs under different machine load; here one
lowering is compiled once per option set (`Lowered.compile(compiler_options)`, the same DebugOptions
fields XLA_FLAGS sets) and the executables alternate call by call (the order flips each round), so
every set sees the same load. Prints per set the median and minimum wall and CPU seconds of a step
and the first step's loss (a changed loss would mean the options changed the numerics).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import flags

from dsv3_jax import cli

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

# Option sets by name; the enum values are those of xla/backends/cpu/{ynn,xnn}_fusion_options.proto.
OPTION_SETS = {
    "none": {},
    "dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "idot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
    "greedy": {"xla_cpu_experimental_xnn_graph_fusion_mode": "XNN_GRAPH_FUSION_MODE_GREEDY"},
}


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def compare(variant: str, rounds: int, set_names: list[str], batch: int = 8, seq: int = 256) -> dict:
    """{set name: (wall seconds per round, CPU seconds per round, first loss)}."""
    import jax

    from benchmarks import bench_workers

    unknown = [name for name in set_names if name not in OPTION_SETS]
    if unknown:
        raise ValueError(f"unknown option sets {unknown}; known: {sorted(OPTION_SETS)}")
    step, state, data = bench_workers.jax_train_parts(variant, None, batch, seq, donate=False)
    lowered = step.func.lower(state, data, **step.keywords)
    executables = {name: lowered.compile(OPTION_SETS[name]) for name in set_names}
    results = {}
    for name, exe in executables.items():
        _, metrics = exe(state, data, **step.keywords)
        results[name] = ([], [], float(metrics["loss"]))
    order = list(executables)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            start, used = time.perf_counter(), _cpu_s()
            jax.block_until_ready(executables[name](state, data, **step.keywords))
            results[name][0].append(time.perf_counter() - start)
            results[name][1].append(_cpu_s() - used)
    return results


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("variant", "bench", "a config of benchmarks/bench_workers.py VARIANTS", flag_values=fv)
    flags.DEFINE_integer("rounds", 8, "timing rounds (the order flips each round)", flag_values=fv)
    flags.DEFINE_string("sets", "none,dot,idot,greedy", "option sets, comma-separated", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    results = compare(args.variant, args.rounds, args.sets.split(","))
    print("| variant | options | wall s/step median (min) | CPU s/step median (min) | loss |\n|---|---|---|---|---|")
    for name, (wall, cpu, loss) in results.items():
        print(f"| {args.variant} | {name} | {statistics.median(wall):.3f} ({min(wall):.3f}) | "
              f"{statistics.median(cpu):.3f} ({min(cpu):.3f}) | {loss:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

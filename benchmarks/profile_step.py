"""Top operations of the bench's train step (or one decode step) by time, from a jax.profiler trace.

    python -m benchmarks.profile_step [--what=train|decode|prefill] [--variant=e32_top4] [--steps=3] [--top=25]
                                      [--page_size=64]

Traces a few steps of benchmarks.bench's issue config or one of its sweep's --variant configs
(benchmarks/bench_workers.py VARIANTS) after compiling; `prefill` is one 4K-prompt prefill (through a
paged cache with --page_size, as `benchmarks.bench --page_size` times it), reads the XLA:CPU op
events of the perfetto trace, names each fused op by the jax operation it came from (the HLO
metadata of the compiled program) and prints a markdown table: ms per step, share, fwd/bwd, op;
then each part's share of the step (`GROUPS`: routed experts, head, attention, optimizer, ...).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

from absl import flags

from dsv3_jax import cli

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

_SKIP = ("ThunkExecutor", "$", "PjitFunction", "Slinky", "while", "conditional", "cond.", "call", "Execute")


def op_names(dump_dir: str) -> dict[tuple[str, str], str]:
    """(HLO module, instruction) -> the jax op_name in its metadata, from XLA's optimized-HLO dumps."""
    names = {}
    for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        module = re.match(r"module_\d+\.(.*?)\.", os.path.basename(path)).group(1)
        for line in open(path):
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]*)\"", line)
            if m:
                names[(module, m.group(1))] = m.group(2)
    return names


def category(op_name: str) -> str:
    """'bwd attention: BTHK,BSHK->BHTS/dot_general' style label from a jax op_name."""
    phase = "bwd" if "transpose(" in op_name else "fwd"
    op = re.sub(r"^jit\(train_step\)/", "", op_name)
    op = re.sub(r"(transpose|jvp|remat|checkpoint)\(", "", op).replace(")", "")
    op = re.sub(r"(while/body/)?closed_call/|while/body/", "", op).strip("/")
    return f"{phase} {op[:80]}"


# What each op of the train step belongs to, first match wins (op labels as `category` writes them).
GROUPS = (
    ("routed experts", r"E[CDF][DF],E[CDF][DF]"),
    ("head + cross-entropy", r"BCV|BCD|,DV->|->DV"),
    ("attention", r"BH[TWS]"),
    ("other matmuls (MLA projections, dense and shared MLPs)", r"/dot_general$"),
    ("optimizer + state update", r"^fwd (jit\(_where/select_n|div|mul|add|sqrt|sub|max|reduce_sum|integer_pow)$"),
    ("layer stack slices + gradient concatenation", r"^(fwd|bwd) (slice|concatenate)$"),
    ("dispatch: gathers, sorts, routing", r"gather|scatter|sort|top_k|cumsum"),
)
OTHER = "other (norms, activations, elementwise)"


def group_shares(totals: dict[str, float]) -> list[tuple[str, float]]:
    """(group, share of the whole op time) for op labels -> time, largest first (GROUPS, OTHER)."""
    grouped = collections.Counter()
    for label, us in totals.items():
        grouped[next((name for name, pattern in GROUPS if re.search(pattern, label)), OTHER)] += us
    whole = sum(grouped.values()) or 1.0
    return [(name, us / whole) for name, us in grouped.most_common()]


def top_ops(trace_dir: str, dump_dir: str, steps: int, top: int, by_part: bool) -> str:
    """The op table; with `by_part` (a train step: GROUPS name its parts) each part's share after it."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names, totals = op_names(dump_dir), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(_SKIP):
            key = (e.get("args", {}).get("hlo_module", ""), e["name"])
            totals[category(names.get(key, f"{key[0]}/{key[1]} (no metadata)"))] += e.get("dur", 0)
    whole = sum(totals.values())
    lines = [f"Op time summed over threads: {whole / steps / 1e3:.0f} ms per step.", "",
             "| ms/step | share | op (jax op_name, fwd/bwd) |", "|---|---|---|"]
    for name, us in totals.most_common(top):
        lines.append(f"| {us / steps / 1e3:.1f} | {100 * us / whole:.1f}% | `{name}` |")
    if by_part:
        lines += ["", "By part: " + "; ".join(f"{name} {100 * share:.0f}%" for name, share in group_shares(totals)) + "."]
    return "\n".join(lines)


def workload(what: str, variant: str = "issue", page_size: int = 0):
    """A callable running one train step, one greedy generate of 16 tokens after a 4K prompt, or
    the prefill of a 4K prompt to its first token."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dsv3_bench_workers", os.path.join(_ROOT, "benchmarks", "bench_workers.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if what == "train":
        return bench.jax_train_workload(variant, None, 8, 256)
    return bench.jax_decode_workload(4096, 1, 17 if what == "decode" else 1, variant, page_size)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_enum("what", "train", ["train", "decode", "prefill"], "the step to trace", flag_values=fv)
    flags.DEFINE_string("variant", "issue", "a config of benchmarks/bench_workers.py VARIANTS", flag_values=fv)
    flags.DEFINE_integer("steps", 3, "traced steps", flag_values=fv)
    flags.DEFINE_integer("top", 25, "operations listed", flag_values=fv)
    flags.DEFINE_integer("page_size", 0, "decode / prefill through a paged cache of pages of this many tokens "
                         "(0: the contiguous cache)", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    dump_dir = tempfile.mkdtemp(prefix="profile_hlo_")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
    import jax  # after XLA_FLAGS: the dump flags are read when the backend starts

    call = workload(args.what, args.variant, args.page_size)
    call()  # compile
    trace_dir = tempfile.mkdtemp(prefix="profile_trace_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            call()
    print(top_ops(trace_dir, dump_dir, args.steps, args.top, by_part=args.what == "train"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

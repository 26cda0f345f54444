"""Each Pallas kernel against its XLA alternative at the 671B's shapes, a train step that fills the
device (bf16 and the FP8 recipe) and prefill / decode throughput: one JSON, one markdown table.

    python -m benchmarks.device_report --out=DIR [--budget_s=420] [--only=fp8_gemm,train_bf16] [--smoke]

Rows, in this order (`ROWS`; shapes in benchmarks/device_report_kernels.py and
benchmarks/device_report_model.py): the FP8 block-scaled GEMM; the FP8 grouped GEMM against
ragged_dot at the 671B's expert shapes; MLA decode over a bf16 and an fp8 cache; MLA prefill,
forward and forward + backward; the train step in bf16 and with the FP8 recipe (MFU); the int8
and int4 grouped GEMMs; prefill and decode tokens/s through `generate`. A kernel row has both
implementations' times, the largest difference between their outputs relative to the XLA side's
largest value, TFLOP/s and GB/s as fractions of the device's peak (benchmarks/peaks.py), and the
faster of the two. The model rows run with the attention implementation the kernel rows found
faster (training: prefill forward + backward; inference: bf16 decode; `xla` where that row did not
run).

A row that fails (a kernel that does not lower here, out of memory) records its one-line error and
the report goes on. Rows start while --budget_s has not run out; the rest are marked skipped.
DIR/report.json and DIR/report.md are rewritten after every row, so a run cut short keeps what it
measured (rows not reached read "pending"). report.json's "defaults" say, per op, which
implementation was faster here and the ModelConfig field or the code that chooses it.
`--smoke`: tiny shapes, the kernels through the Pallas interpreter on CPU; it shows that the
script works, its figures are not performance; without it a CPU-only host is refused. Exit codes:
0 whatever the rows' results; 2 for a bad flag or a CPU-only host without --smoke.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import time
from typing import Callable, NamedTuple

import jax
from absl import flags

from benchmarks import device_report_kernels as kernels
from benchmarks import device_report_model as model
from benchmarks.bench_kernels import rel_err, timeit
from benchmarks.device_report_md import markdown
from benchmarks.peaks import PEAKS, Peak, achieved, device_peak
from dsv3_jax import cli, host, paths


class Row(NamedTuple):
    what: str
    kind: str  # "kernel", "train" or "inference": its table in the markdown
    run: Callable  # (Context) -> dict of figures


class Context(NamedTuple):
    kernel_shapes: kernels.KernelShapes
    model_shapes: model.ModelShapes
    peak: Peak | None
    iters: int
    rows: dict  # the report's rows so far, by name


def kernel_row(what: str, build: Callable) -> Row:
    """A row timing `build(shapes)`'s KernelCase: each side alone (a failure of one is recorded and
    the other still runs), their relative error, achieved rates, the faster."""
    def run(ctx: Context) -> dict:
        case = build(ctx.kernel_shapes)
        out = {"shape": case.shape, "xla_form": case.xla_form, "flops": case.flops,
               "peak_kind": "fp8" if case.fp8 else "bf16"}
        for side in ("pallas", "xla"):
            impl = getattr(case, side)
            try:
                out[side] = achieved(timeit(impl.fn, case.args, ctx.iters), case.flops, impl.bytes, ctx.peak,
                                     case.fp8) | {"bytes": impl.bytes}
            except Exception as e:  # noqa: BLE001 (a kernel that fails here is a result)
                out[side] = {"error": one_line(e)}
        timed = [side for side in ("pallas", "xla") if "s" in out[side]]
        if not timed:
            raise RuntimeError(f"both sides failed; pallas: {out['pallas']['error']}")
        out["rel_err"] = None
        if len(timed) == 2:
            try:
                out["rel_err"] = rel_err(case.pallas.fn, case.xla.fn, case.args)
            except Exception as e:  # noqa: BLE001 (e.g. out of memory holding both outputs: the times stand)
                out["rel_err_error"] = one_line(e)
        out["faster"] = min(timed, key=lambda side: out[side]["s"])
        return out

    return Row(what, "kernel", run)


def faster(rows: dict, name: str) -> str:
    """The attention implementation row `name` found faster ("pallas" / "xla"), else "xla"."""
    return rows.get(name, {}).get("faster") or "xla"


ROWS = {
    "fp8_gemm": kernel_row("FP8 block-scaled GEMM", kernels.fp8_gemm),
    "fp8_grouped": kernel_row("FP8 grouped GEMM (experts) vs bf16 ragged_dot", kernels.fp8_grouped),
    "mla_decode_bf16": kernel_row("MLA decode, bf16 cache", functools.partial(kernels.mla_decode, "bfloat16")),
    "mla_decode_fp8": kernel_row("MLA decode, fp8 cache", functools.partial(kernels.mla_decode, "float8")),
    "mla_prefill": kernel_row("MLA prefill forward", kernels.mla_prefill),
    "mla_prefill_bwd": kernel_row("MLA prefill forward + backward", kernels.mla_prefill_bwd),
    "train_bf16": Row("train step, bf16", "train", lambda ctx: model.train(
        ctx.model_shapes, ctx.peak, fp8=False, attention_impl=faster(ctx.rows, "mla_prefill_bwd"))),
    "train_fp8": Row("train step, FP8 recipe", "train", lambda ctx: model.train(
        ctx.model_shapes, ctx.peak, fp8=True, attention_impl=faster(ctx.rows, "mla_prefill_bwd"))),
    "int8_grouped": kernel_row("int8 grouped GEMM", functools.partial(kernels.int_grouped, "int8")),
    "int4_grouped": kernel_row("int4 grouped GEMM", functools.partial(kernels.int_grouped, "int4")),
    "inference": Row("prefill and decode through generate", "inference", lambda ctx: model.inference(
        ctx.model_shapes, attention_impl=faster(ctx.rows, "mla_decode_bf16"))),
}


class Default(NamedTuple):
    row: str
    config_field: str | None  # the ModelConfig field that selects it, if one does
    values: dict  # "pallas" / "xla" -> the field's value, or what the code would do
    choice_point: str  # file:name of the code that makes the choice


_ATTENTION = {"pallas": "pallas", "xla": "xla"}
_KERNEL = {"pallas": "the Pallas kernel (as now)", "xla": "the XLA form instead"}
DEFAULTS = {
    "fp8_gemm": Default("fp8_gemm", None, _KERNEL, "dsv3_jax/ops/linear.py:_matmul"),
    "fp8_grouped_vs_bf16": Default("fp8_grouped", "fp8_matmul", {"pallas": True, "xla": False},
                                   "dsv3_jax/ops/dispatch.py:_grouped_mm"),
    "int8_grouped": Default("int8_grouped", None, _KERNEL, "dsv3_jax/ops/dispatch.py:_grouped_mm"),
    "int4_grouped": Default("int4_grouped", None, _KERNEL, "dsv3_jax/ops/dispatch.py:_grouped_mm"),
    "attention_prefill": Default("mla_prefill", "attention_impl", _ATTENTION,
                                 "dsv3_jax/model/attention.py:_attention_fn"),
    "attention_train": Default("mla_prefill_bwd", "attention_impl", _ATTENTION,
                               "dsv3_jax/model/attention.py:_attention_fn"),
    "attention_decode_bf16": Default("mla_decode_bf16", "attention_impl", _ATTENTION,
                                     "dsv3_jax/model/attention.py:MLA.absorbed"),
    "attention_decode_fp8": Default("mla_decode_fp8", "attention_impl", _ATTENTION,
                                    "dsv3_jax/model/attention.py:MLA.absorbed"),
}


def defaults(rows: dict) -> dict:
    """Per op: the faster implementation measured (None: not measured) and what selects it; the
    train recipe by tokens/s of the two train rows (None unless both ran)."""
    out = {}
    for op, d in DEFAULTS.items():
        row = rows.get(d.row, {})
        won = row.get("faster")
        out[op] = {"row": d.row, "faster": won, "config_field": d.config_field,
                   "set_to": d.values[won] if won else None, "choice_point": d.choice_point}
        if "error" in row.get("pallas", {}):  # "xla faster" because the kernel failed here
            out[op]["pallas_error"] = row["pallas"]["error"]
    rates = {recipe: rows.get(f"train_{recipe}", {}).get("tokens_per_s") for recipe in ("bf16", "fp8")}
    won = max(rates, key=rates.get) if all(rates.values()) else None
    out["train_recipe"] = {"row": "train_bf16, train_fp8", "faster": won, "config_field": "fp8_matmul",
                           "set_to": {"bf16": False, "fp8": True}.get(won),
                           "choice_point": "dsv3_jax/config.py:ModelConfig"}
    return out


def one_line(e: BaseException) -> str:
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first.strip()[:300]}"


def write(out_dir: str, report: dict) -> None:
    """report.json and report.md, each replaced whole (a reader never sees half a file)."""
    report["defaults"] = defaults(report["rows"])
    paths.write_text(os.path.join(out_dir, "report.json"), json.dumps(report, indent=1))
    paths.write_text(os.path.join(out_dir, "report.md"), markdown(report))


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("out", None, "folder for report.json and report.md", required=True, flag_values=fv)
    flags.DEFINE_float("budget_s", 420.0, "start no row after this many seconds; the rest are skipped", flag_values=fv)
    flags.DEFINE_list("only", None, f"rows to run, of {','.join(ROWS)} (default: all)", flag_values=fv)
    flags.DEFINE_integer("iters", 5, "timed calls per kernel side (after one that compiles)", flag_values=fv)
    flags.DEFINE_boolean("smoke", False, "tiny shapes, to show on CPU that the script works", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    names = args.only or list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        cli.usage(f"--only: unknown rows {unknown}; known: {','.join(ROWS)}")
    if args.budget_s <= 0 or args.iters < 1:
        cli.usage(f"--budget_s={args.budget_s} and --iters={args.iters} must be positive")
    if not args.smoke and host.on_cpu():  # the 671B's shapes through the Pallas interpreter: hours
        cli.usage("the report measures an accelerator at the 671B's shapes and this host has only CPU devices; "
                  "run it on a GPU or TPU, or pass --smoke to check the script here")
    try:
        return run(args, names)
    except OSError as e:  # --out cannot be written
        return cli.fail(e, args.out)


def run(args, names: list[str]) -> int:
    """The rows `names` in order within the budget, the report rewritten after each; prints the markdown."""
    os.makedirs(args.out, exist_ok=True)
    kind, peak = device_peak()
    ctx = Context(kernels.SMOKE_SHAPES if args.smoke else kernels.KernelShapes(),
                  model.SMOKE_MODEL if args.smoke else model.ModelShapes(), peak, 1 if args.smoke else args.iters, {})
    report = {"meta": {"device_kind": kind, "platform": jax.devices()[0].platform, "jax": jax.__version__,
                       "peak": peak._asdict() if peak else None, "smoke": args.smoke, "budget_s": args.budget_s,
                       "command": "python -m benchmarks.device_report " + " ".join(args.argv)},
              "peaks": {key: p._asdict() for key, p in PEAKS.items()},
              "rows": {name: {"what": ROWS[name].what, "kind": ROWS[name].kind, "status": "pending"} for name in names}}
    start = time.perf_counter()
    write(args.out, report)
    for i, name in enumerate(names, 1):
        elapsed = time.perf_counter() - start
        row = report["rows"][name]
        if elapsed >= args.budget_s:
            row.update(status="skipped", reason=f"budget of {args.budget_s:.0f} s spent")
        else:
            eta = f", about {elapsed / (i - 1) * (len(names) - i + 1):.0f} s to go" if i > 1 else ""
            print(f"[{i}/{len(names)}] {name}: starting at {elapsed:.0f} s{eta}", file=sys.stderr, flush=True)
            row.update(run_row(ROWS[name], ctx))
            print(f"[{i}/{len(names)}] {name}: {row['status']} in {row['seconds']:.1f} s", file=sys.stderr, flush=True)
        ctx.rows[name] = row
        report["meta"]["elapsed_s"] = time.perf_counter() - start
        write(args.out, report)
    print(markdown(report))
    return 0


def run_row(row: Row, ctx: Context) -> dict:
    """The row's figures and "status": "ok", or "error" with its one-line message; "seconds" it took."""
    start = time.perf_counter()
    try:
        out = {"status": "ok", **row.run(ctx)}
    except Exception as e:  # noqa: BLE001 (the row's failure is its result; the report goes on)
        out = {"status": "error", "error": one_line(e)}
    gc.collect()  # the row's arrays, before the next row allocates its own
    return out | {"seconds": time.perf_counter() - start}


if __name__ == "__main__":
    cli.exit_with(main())

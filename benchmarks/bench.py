"""Speed of dsv3-jax beside HF transformers on this machine, each measure in its own processes.

    python -m benchmarks.bench                         # everything, 3 alternating repeats
    python -m benchmarks.bench --only=train,experts --repeats=2
    python -m benchmarks.bench --baseline=/tmp/base    # adds a "before" column: dsv3-jax from that tree
    python -m benchmarks.bench --only=sweep --repeats=1 # the grid of config variants (bench_workers.GRID)

Measures (the bench config, `bench_workers.BENCH_CONFIG`: vocab 4096, hidden 256, 4 layers of which 1 dense, 4 heads, q/kv
LoRA 128/64, nope/rope/v 32/16/32, 16 routed experts top-2 in 4 groups keeping 2, 1 shared,
expert width 128, dense width 512, fp32, no MTP, random init; batch 8 x 256):
- train: fwd + bwd + clipped AdamW tokens/s and MFU against the fp32 matmul peak measured in this
  run (the best of jax's and torch's 2048^3 matmul); `small` at batch 1 x 1024 with --small. The
  step donates its state, as `experiments.train` runs it (torch's AdamW updates in place).
- experts: step time at 8, 32 and 128 routed experts (same top-2, same tokens).
- decode: greedy decode tokens/s (after prefill) at batch 1 and 8 for 1K and 4K prompts.
- trainer: `experiments.train` end to end (data, loop, metrics) against the bare step.
- sweep: for each config variant of --variants (bench_workers.VARIANTS: width, head count, top-k,
  expert groups and vocabulary changed; default bench_workers.GRID): the train step (--sweep_train),
  the prefill to the first token (`generate(..., 1)`; with --page_size through a paged cache of
  pages of that many tokens, as the server runs it) of each --sweep_prefill point and decode at
  each --sweep_decode point (batch 8 after 1K and after 4K prompts); a table of every ratio to transformers and each measure's minimum over the grid.
  --quick shrinks every shape (for the CLI test).
Every worker is a fresh process; frameworks alternate within a repeat and the order flips between
repeats. Medians over repeats; ratios are taken between figures of the same run. Writes the JSON
(--json) and the markdown report (--out, default docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:  # run as a script (the --baseline worker) as well as with -m
    sys.path.append(_ROOT)


def workers():
    """benchmarks/bench_workers.py, loaded by path (a --baseline tree on sys.path has its own
    `experiments` package, which may not have it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dsv3_bench_workers", os.path.join(_HERE, "bench_workers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------ driver
def run_worker(fn: str, kwargs: dict, tree: str, timeout: int) -> dict:
    """One worker in a fresh process with `tree` first on the path; its result and peak RSS."""
    # PASSIVE: torch's OpenMP threads sleep instead of spinning at barriers; on a shared machine
    # spinning made transformers' step up to 10x slower, so this is the fair setting for it.
    from dsv3_jax import host  # the driver's tree (workers may run a --baseline tree)

    # Huge pages for malloc (dsv3_jax/host.py) in every worker, both frameworks alike.
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    env = host.with_tunable(env) if host.wanted(env) else env
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps([fn, kwargs])],
                                cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
        start = time.perf_counter()
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
        proc.returncode = status
        out.seek(0)
        text = out.read()
    lines = [ln for ln in text.splitlines() if ln.startswith("BENCH_RESULT ")]
    if not lines:
        print(f"  worker {fn}{kwargs} failed (status {status}):\n" + text[-3000:], flush=True)
        return {"error": text[-500:]}
    result = json.loads(lines[-1][len("BENCH_RESULT "):])
    result["peak_rss_gb"] = usage.ru_maxrss / 2**20
    return result


def plan(args) -> list[tuple[str, str, str, dict]]:
    """(measure, framework, worker, kwargs) for one repeat."""
    jobs = []
    if "train" in args.only:
        jobs.append(("train issue", "train", dict(name="issue", experts=None, batch=8, seq=256, steps=args.steps)))
        if args.small:
            jobs.append(("train small", "train", dict(name="small", experts=None, batch=1, seq=1024, steps=2)))
    if "experts" in args.only:
        for e in (8, 32, 128):
            jobs.append((f"experts {e}", "train", dict(name="issue", experts=e, batch=8, seq=256, steps=args.steps)))
    if "decode" in args.only:
        for point in args.decode:
            prompt, batch = (int(x) for x in point.split("x"))
            size = f"{prompt // 1024}K" if prompt % 1024 == 0 else str(prompt)
            jobs.append((f"decode {size} b{batch}", "decode",
                         dict(prompt=prompt, batch=batch, new_tokens=args.new_tokens)))
    if "trainer" in args.only:
        jobs.append(("trainer", "trainer", dict(steps=args.steps)))
    if "sweep" in args.only:
        jobs += sweep_jobs(args)
    out = []
    for measure, kind, kwargs in jobs:
        for fw in frameworks(args, kind, measure):
            worker = "jax_trainer" if kind == "trainer" else f"{'hf' if fw == 'hf' else 'jax'}_{kind}"
            out.append((measure, fw, worker, kwargs))
    return out


def _size(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _points(spec: list[str]) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in point.split("x")) for point in spec]


def sweep_jobs(args) -> list[tuple[str, str, dict]]:
    """(measure, kind, kwargs) of the sweep: per variant a train step, each prefill point, each decode point."""
    jobs = []
    for name in args.variants:
        (batch, seq), = _points([args.sweep_train]) if "train" in args.sweep_measures else [(0, 0)]
        jobs.append((f"{name}: train", "train", dict(name=name, experts=None, batch=batch, seq=seq, steps=args.steps))) if batch else None
        paged = f" paged {args.page_size}" if args.page_size else ""
        for prompt, batch in _points(args.sweep_prefill) if "prefill" in args.sweep_measures else []:
            jobs.append((f"{name}: prefill {_size(prompt)} b{batch}{paged}", "prefill",
                         dict(name=name, prompt=prompt, batch=batch, repeats=args.prefill_repeats,
                              page_size=args.page_size)))
        for prompt, batch in _points(args.sweep_decode) if "decode" in args.sweep_measures else []:
            jobs.append((f"{name}: decode {_size(prompt)} b{batch}", "decode",
                         dict(name=name, prompt=prompt, batch=batch, new_tokens=args.new_tokens)))
    return jobs


def frameworks(args, kind: str, measure: str) -> list[str]:
    before = args.baseline and (measure in args.baseline_measures or ": " in measure)  # the sweep: all of it
    fws = ["jax"] + (["before"] if before else [])
    if kind != "trainer" and not args.no_hf:
        fws.append("hf")
    return fws


def summarize(results: dict, args) -> dict:
    """Medians over repeats of tokens/s, step times, MFU, compile time; ratios between frameworks."""
    from dsv3_jax.train.metrics import flops_per_token

    peaks = [r["peak"] for runs in results.values() for r in runs if "peak" in r]
    peak = max(peaks) if peaks else float("nan")
    table = {}
    kwargs = {j[0]: j[3] for j in plan(args)}
    for (measure, fw), runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            table[f"{measure} | {fw}"] = {"error": runs[-1].get("error", "")[-200:]}
            continue
        row, kw = {"peak_rss_gb": max(r["peak_rss_gb"] for r in ok)}, kwargs[measure]
        if "decode_s" in ok[0]:
            rates = [kw["batch"] * (kw["new_tokens"] - 1) / statistics.median(r["decode_s"]) for r in ok]
            row.update(tokens_per_s=statistics.median(rates), compile_s=ok[0]["compile_s"])
        elif "prefill_s" in ok[0]:
            seconds = statistics.median(statistics.median(r["prefill_s"]) for r in ok)
            row.update(seconds=seconds, tokens_per_s=kw["batch"] * kw["prompt"] / seconds, compile_s=ok[0]["compile_s"])
        else:
            step = statistics.median(statistics.median(r["step_s"]) for r in ok)
            tokens = kw.get("batch", 8) * kw.get("seq", 256)
            row.update(step_s=step, tokens_per_s=tokens / step)
            if all(r.get("cpu_step_s") for r in ok):  # CPU seconds a step: the work, less the waits for a core
                row["cpu_step_s"] = statistics.median(statistics.median(r["cpu_step_s"]) for r in ok)
            if "first_step_s" in ok[0]:
                row["compile_s"] = ok[0]["first_step_s"] - step
                cfg = workers().model_config(kw["name"], kw["experts"])
                row["mfu"] = flops_per_token(cfg, kw["seq"]) * tokens / step / peak
        table[f"{measure} | {fw}"] = row
    return {"peak_flops": peak, "rows": table}


def markdown(summary: dict, args, meta: dict) -> str:
    rows, fws = summary["rows"], ["jax", "before", "hf"]
    lines = [f"Machine: {meta['machine']}; load average {meta['load_start']} at the start, "
             f"{meta['load_end']} at the end; {meta['versions']}.", "",
             f"Command: `{meta['command']}` ({args.repeats} alternating repeats, medians; "
             f"fp32 matmul peak measured in the run: {summary['peak_flops'] / 1e9:.1f} GFLOP/s).", "",
             "| measure | framework | tokens/s | step (prefill) s | MFU | compile s | peak RSS GB | vs HF | vs before |",
             "|---|---|---|---|---|---|---|---|---|"]
    measures = list(dict.fromkeys(k.split(" | ")[0] for k in rows))
    for measure in measures:
        for fw in fws:
            row = rows.get(f"{measure} | {fw}")
            if row is None:
                continue
            if "error" in row:
                lines.append(f"| {measure} | {fw} | failed: {row['error'][-80:]!r} | | | | | | |")
                continue
            cells = [measure, fw, f"{row['tokens_per_s']:,.0f}", _fmt(row.get("step_s", row.get("seconds")), ".3f"),
                     _fmt(100 * row["mfu"] if "mfu" in row else None, ".1f", "%"), _fmt(row.get("compile_s"), ".1f"),
                     _fmt(row["peak_rss_gb"], ".2f")]
            for other in ("hf", "before"):
                ref = rows.get(f"{measure} | {other}")
                good = fw != other and ref and "error" not in ref
                cells.append(f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if good else "")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *derived(rows), *sweep_table(rows)]
    return "\n".join(lines) + "\n"


def sweep_table(rows: dict) -> list[str]:
    """The sweep's ratios: dsv3-jax / transformers tokens/s per variant and measure (and the
    baseline's, if any), then each measure's minimum over the variants."""
    keys = [k.split(" | ")[0] for k in rows if ": " in k.split(" | ")[0]]
    variants = list(dict.fromkeys(k.split(": ")[0] for k in keys))
    measures = list(dict.fromkeys(k.split(": ")[1] for k in keys))
    if not variants:
        return []

    def ratio(variant, measure, fw):
        row, ref = rows.get(f"{variant}: {measure} | {fw}"), rows.get(f"{variant}: {measure} | hf")
        ok = row and ref and "error" not in row and "error" not in ref
        return row["tokens_per_s"] / ref["tokens_per_s"] if ok else None

    fws = [fw for fw in ("jax", "before") if any(f" | {fw}" in k for k in rows)]
    lines = ["", "Sweep, dsv3-jax tokens/s over transformers' (" + " / ".join(
        {"jax": "this tree", "before": "the baseline tree"}[fw] for fw in fws) + "):", "",
             "| variant | " + " | ".join(measures) + " |", "|---" * (len(measures) + 1) + "|"]
    for variant in variants:
        cells = [" / ".join(_fmt(ratio(variant, m, fw), ".2f", "x") or "-" for fw in fws) for m in measures]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    mins = []
    for m in measures:
        per_fw = []
        for fw in fws:
            got = [r for r in (ratio(v, m, fw) for v in variants) if r is not None]
            per_fw.append(f"{min(got):.2f}x" if got else "-")
        mins.append(" / ".join(per_fw))
    lines.append("| **minimum** | " + " | ".join(f"**{c}**" for c in mins) + " |")
    cpu = []
    for variant in variants:
        ref = rows.get(f"{variant}: train | hf", {})
        got = [(fw, rows.get(f"{variant}: train | {fw}", {})) for fw in fws]
        if ref.get("cpu_step_s") and all(row.get("cpu_step_s") for _, row in got):
            cpu.append(f"{variant} " + " / ".join(f"{ref['cpu_step_s'] / row['cpu_step_s']:.2f}x" for _, row in got))
    if cpu:  # on a loaded machine wall time also counts the waits for a core, which CPU time does not
        lines += ["", "Train step by CPU seconds (user + system, all threads) a step, transformers' over "
                  "dsv3-jax's: " + ", ".join(cpu) + "."]
    return lines


def derived(rows: dict) -> list[str]:
    out = []
    for fw in ("jax", "before", "hf"):
        e8, e128 = rows.get(f"experts 8 | {fw}"), rows.get(f"experts 128 | {fw}")
        if e8 and e128 and "error" not in e8 and "error" not in e128:
            out.append(f"- {fw}: step time at 128 experts / 8 experts = {e128['step_s'] / e8['step_s']:.2f}")
    for fw in ("jax", "before"):
        trainer, bare = rows.get(f"trainer | {fw}"), rows.get(f"train issue | {fw}")
        if trainer and bare and "error" not in trainer and "error" not in bare:
            out.append(f"- {fw}: experiments.train end to end / bare step tokens/s = "
                       f"{trainer['tokens_per_s'] / bare['tokens_per_s']:.2f}")
    return out


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def machine() -> dict:
    import jax

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = f"jax {jax.__version__}"
    try:
        import torch
        import transformers

        versions += f", torch {torch.__version__}, transformers {transformers.__version__}"
    except ImportError:
        pass
    return {"machine": f"{platform.machine()} {os.cpu_count()} cores, {mem:.0f} GiB RAM, {jax.default_backend()}",
            "versions": versions, "load_start": _load(), "command": "python -m benchmarks.bench " + " ".join(sys.argv[1:])}


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_list("only", "train,experts,decode,trainer", "measures to run", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "runs of every measure, alternating before/after", flag_values=fv)
    flags.DEFINE_integer("steps", 5, "timed train steps per process (after one warm-up)", flag_values=fv)
    flags.DEFINE_integer("new_tokens", 33, "generated tokens per decode measure", flag_values=fv)
    flags.DEFINE_boolean("small", False, "also train `small` at batch 1 x 1024 (slow)", flag_values=fv)
    flags.DEFINE_string("baseline", None, "a source tree of dsv3-jax to measure as 'before'", flag_values=fv)
    flags.DEFINE_list("baseline_measures", "train issue,trainer", "measures that also run the baseline tree",
                      flag_values=fv)
    flags.DEFINE_list("decode", "1024x1,1024x8,4096x1,4096x8", "decode points PROMPTxBATCH", flag_values=fv)
    flags.DEFINE_list("variants", None, "sweep: config variants (benchmarks/bench_workers.py VARIANTS), default "
                      "its GRID", flag_values=fv)
    flags.DEFINE_string("sweep_train", "8x256", "sweep: train step BATCHxSEQ", flag_values=fv)
    flags.DEFINE_list("sweep_prefill", "4096x1,1024x8", "sweep: prefill points PROMPTxBATCH", flag_values=fv)
    flags.DEFINE_list("sweep_decode", "1024x8,4096x8", "sweep: decode points PROMPTxBATCH", flag_values=fv)
    flags.DEFINE_list("sweep_measures", "train,prefill,decode", "sweep: which of train, prefill, decode to run",
                      flag_values=fv)
    flags.DEFINE_integer("prefill_repeats", 2, "sweep: timed prefills per process", flag_values=fv)
    flags.DEFINE_integer("page_size", 0, "sweep: prefill through a paged cache of pages of this many tokens "
                         "(`generate(page_size=)`, the server's layout); 0: the contiguous cache", flag_values=fv)
    flags.DEFINE_boolean("quick", False, "sweep: tiny shapes (train 2x32, prefill 64x2, decode 64x2, 2 steps, 5 new "
                         "tokens), for a test of the command", flag_values=fv)
    flags.DEFINE_boolean("no_hf", False, "skip transformers even when torch is installed", flag_values=fv)
    flags.DEFINE_integer("timeout", 1800, "seconds per worker process", flag_values=fv)
    flags.DEFINE_string("json", "runs/bench.json", "the figures as JSON", flag_values=fv)
    flags.DEFINE_string("out", "docs/benchmarks.md", "the report to update", flag_values=fv)


def main(argv=None) -> int:
    from dsv3_jax import cli  # here, not at the top: a worker process runs a --baseline tree's dsv3_jax

    args = cli.parse(define_flags, argv, __doc__)
    args.no_hf = args.no_hf or not _has_torch()
    try:
        check_sweep_args(args)
    except ValueError as e:
        cli.usage(str(e))
    meta, results, jobs = machine(), {}, plan(args)
    for repeat in range(args.repeats):
        for i, (measure, fw, worker, kwargs) in enumerate(_alternate(jobs, repeat)):
            tree = os.path.abspath(args.baseline) if fw == "before" else _ROOT
            r = run_worker(worker, kwargs, tree, args.timeout)
            results.setdefault((measure, fw), []).append(r)
            print(f"[repeat {repeat + 1}/{args.repeats}, {i + 1}/{len(jobs)}] {measure} {fw}: "
                  f"{_short(r)}", flush=True)
    meta["load_end"] = _load()
    summary = summarize(results, args)
    text = markdown(summary, args, meta)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "summary": summary, "raw": {" | ".join(k): v for k, v in results.items()}}, f, indent=1)
    write_report(args.out, text)
    return 0


def worker_main(spec: str) -> None:
    """A worker process (run_worker): runs spec = JSON [worker, kwargs] and prints its result. It parses
    no flags: it may run in a --baseline tree, with that tree's dsv3_jax."""
    fn, kwargs = json.loads(spec)
    print("BENCH_RESULT " + json.dumps(workers().WORKERS[fn](**kwargs)), flush=True)


def check_sweep_args(args) -> None:
    """Variants known and points well formed, else a ValueError naming the flag."""
    names = workers().VARIANTS
    args.variants = args.variants or list(workers().GRID)
    if args.quick:
        args.sweep_train, args.sweep_prefill, args.sweep_decode = "2x32", ["64x2"], ["64x2"]
        args.steps, args.new_tokens = min(args.steps, 2), min(args.new_tokens, 5)
    if args.page_size < 0:
        raise ValueError(f"--page_size: expected 0 (the contiguous cache) or a page of >= 1 token, got {args.page_size}")
    unknown = [v for v in args.variants if v not in names]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; known: {sorted(names)}")
    for flag, spec in (("--sweep_train", [args.sweep_train]), ("--sweep_prefill", args.sweep_prefill),
                       ("--sweep_decode", args.sweep_decode)):
        try:
            points = _points(spec)
        except ValueError:
            points = None
        if not points or any(len(p) != 2 or min(p) < 1 for p in points) or (flag == "--sweep_train" and len(points) != 1):
            raise ValueError(f"{flag}: expected LENGTHxBATCH points (BATCHxSEQ for --sweep_train), "
                             f"got {','.join(spec)!r}")


def _alternate(jobs, repeat: int):
    """Frameworks of one measure in turn; the order flips every repeat."""
    if repeat % 2 == 0:
        return jobs
    out, i = [], 0
    while i < len(jobs):
        j = i
        while j < len(jobs) and jobs[j][0] == jobs[i][0]:
            j += 1
        out += jobs[i:j][::-1]
        i = j
    return out


def _short(r: dict) -> str:
    if "error" in r:
        return "failed"
    if "step_s" in r:
        cpu = f" (CPU {statistics.median(r['cpu_step_s']):.3f} s)" if r.get("cpu_step_s") else ""
        return f"median step {statistics.median(r['step_s']):.3f} s{cpu}, peak RSS {r['peak_rss_gb']:.2f} GB"
    if "prefill_s" in r:
        return "prefill to the first token s: " + ", ".join(f"{s:.3f}" for s in r["prefill_s"])
    return "decode (first to last token) s: " + ", ".join(f"{s:.3f}" for s in r["decode_s"])


def write_report(path: str, table: str) -> None:
    """Replaces the generated section of `path` (between the markers), keeping the rest."""
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    text = open(path).read() if os.path.exists(path) else f"# Benchmarks\n\n{begin}\n{end}\n"
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{head}{begin}\n{table}{end}{tail}")


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker_main(sys.argv[2])
    else:
        sys.exit(main())

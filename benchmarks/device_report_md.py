"""benchmarks/device_report.py's markdown: the kernel table, the train and inference rows, the
measured defaults and the peak table with each figure's source."""

from __future__ import annotations

KERNEL_HEADER = ("| row | shape | Pallas ms | XLA ms | max rel. diff | faster | TFLOP/s Pallas / XLA | "
                 "GB/s Pallas / XLA | % peak compute Pallas / XLA | % peak HBM Pallas / XLA |")
TRAIN_HEADER = "| row | config | step s | tokens/s | TFLOP/s | MFU (bf16 peak) | compile s |"
INFERENCE_HEADER = "| row | config | prefill tokens/s | decode tokens/s | first call s |"


def markdown(report: dict) -> str:
    meta, rows = report["meta"], report["rows"]
    peak = meta["peak"]
    lines = [f"Device: {meta['device_kind']} ({meta['platform']}), jax {meta['jax']}; peak: "
             + (f"bf16 {peak['bf16_tflops']:g} TFLOP/s, fp8 {_num(peak['fp8_tflops'])} TFLOP/s, HBM "
                f"{peak['hbm_tbs']:g} TB/s ({peak['source']})" if peak else "not in the table (fractions n/a)"),
             f"Command: `{meta['command']}`; {meta.get('elapsed_s', 0):.0f} s"
             + (" (smoke: tiny shapes, not performance figures)" if meta["smoke"] else "") + ".", ""]
    for kind, header, cells in (("kernel", KERNEL_HEADER, _kernel_cells), ("train", TRAIN_HEADER, _train_cells),
                                ("inference", INFERENCE_HEADER, _inference_cells)):
        mine = {name: row for name, row in rows.items() if row["kind"] == kind}
        if mine:
            width = header.count("|") - 1
            lines += [header, "|---" * width + "|"]
            lines += [_line([name, *(cells(row) if row["status"] == "ok" else _not_run(row, width - 1))])
                      for name, row in mine.items()]
            lines.append("")
    lines += ["Defaults measured here (report.json `defaults`):", ""]
    for op, d in report.get("defaults", {}).items():
        setting = (f"ModelConfig.{d['config_field']} = {d['set_to']!r}" if d["config_field"] else str(d["set_to"]))
        failed = f" (the kernel failed: {d['pallas_error'][:120]})" if "pallas_error" in d else ""
        lines.append(f"- {op}: " + (f"{d['faster']} faster{failed} ({d['row']}): {setting}; chosen in "
                                    f"{d['choice_point']}" if d["faster"] else f"not measured ({d['row']})"))
    lines += ["", "| device kind | bf16 TFLOP/s | fp8 TFLOP/s | HBM TB/s | source |", "|---|---|---|---|---|"]
    for key, p in report["peaks"].items():
        mark = " (this device)" if p == peak else ""
        lines.append(_line([key + mark, f"{p['bf16_tflops']:g}", _num(p['fp8_tflops']), f"{p['hbm_tbs']:g}",
                            p["source"]]))
    return "\n".join(lines) + "\n"


def _line(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _not_run(row: dict, width: int) -> list[str]:
    why = row.get("error") or row.get("reason") or ""
    return [f"{row['status']}{': ' + why if why else ''}"] + [""] * (width - 1)


def _num(x) -> str:
    return "n/a" if x is None else f"{x:g}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _both(row: dict, fmt) -> str:
    return " / ".join(fmt(row[side]) if "s" in row[side] else "-" for side in ("pallas", "xla"))


def _kernel_cells(row: dict) -> list[str]:
    ms = [f"{1e3 * row[side]['s']:.3f}" if "s" in row[side] else f"failed: {row[side]['error'][:120]}"
          for side in ("pallas", "xla")]
    diff = "n/a" if row["rel_err"] is None else f"{row['rel_err']:.2e}"
    return [row["shape"], *ms, diff, row["faster"], _both(row, lambda s: f"{s['tflops']:.2f}"),
            _both(row, lambda s: f"{s['gbs']:.1f}"), _both(row, lambda s: _pct(s["frac_compute"])),
            _both(row, lambda s: _pct(s["frac_hbm"]))]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _config(c: dict) -> str:
    return (f"{c['layers']} layers, {c['routed_experts']} experts, D {c['hidden']}, {_count(c['params'])} params "
            f"({_count(c['activated_params'])} activated), B {c['batch']} x {c.get('prompt', c['seq'])}, "
            f"attention {c['attention_impl']}")


def _train_cells(row: dict) -> list[str]:
    return [_config(row["config"]), f"{row['step_s']:.3f}", f"{row['tokens_per_s']:,.0f}", f"{row['tflops']:.1f}",
            _pct(row["mfu"]), f"{row['compile_s']:.1f}"]


def _inference_cells(row: dict) -> list[str]:
    return [_config(row["config"]) + f", {row['config']['new_tokens']} new tokens",
            f"{row['prefill_tokens_per_s']:,.0f}", f"{row['decode_tokens_per_s']:,.0f}", f"{row['first_call_s']:.1f}"]

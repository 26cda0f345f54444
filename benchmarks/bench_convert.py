"""Converter benchmark: peak RSS and MB/s of `python -m dsv3_jax.convert` on synthetic checkpoints
of about 1 GB and 4 GB (same widths, more layers), each conversion in its own subprocess.

    python -m benchmarks.bench_convert [--workdir /tmp/dsv3_bench] [--sizes 1,4] [--fp8] [--to-hf]

Pass criteria: peak RSS of the largest within 25% of the smallest, and under 2 GB.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from absl import flags

from dsv3_jax import cli


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """-> (wall seconds, peak RSS bytes) of `cmd` as a child process (its own rusage)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("workdir", "/tmp/dsv3_bench", "where the synthetic checkpoints and outputs go", flag_values=fv)
    flags.DEFINE_list("sizes", "1,4", "GB of tensors of each synthetic checkpoint, comma-separated", flag_values=fv)
    flags.DEFINE_boolean("fp8", False, "synthetic checkpoints in the released FP8 format", flag_values=fv)
    flags.DEFINE_boolean("keep-fp8", False, "convert with --keep-fp8", flag_values=fv)
    flags.DEFINE_boolean("to-hf", False, "also time the export back to HF", flag_values=fv)
    flags.DEFINE_boolean("keep", False, "keep the outputs", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.numbers(args, "sizes", float)
    os.makedirs(args.workdir, exist_ok=True)
    rows = []
    for size in args.sizes:
        tag = f"{size:g}gb{'_fp8' if args.fp8 else ''}"
        hf, ckpt, back = (os.path.join(args.workdir, f"{tag}_{k}") for k in ("hf", "orbax", "hf_back"))
        if not os.path.exists(os.path.join(hf, "config.json")):
            subprocess.run([sys.executable, "-m", "benchmarks.make_synthetic_checkpoint", "--out", hf,
                            "--size-gb", str(size), *(["--fp8"] if args.fp8 else [])], check=True)
        with open(os.path.join(hf, "config.json")) as f:
            hf_cfg = json.load(f)
        shutil.rmtree(ckpt, ignore_errors=True)
        src_bytes = _folder_bytes(hf)
        wall, rss = run_measured([sys.executable, "-m", "dsv3_jax.convert", "--hf-dir", hf, "--out", ckpt,
                                  "--no-progress", *(["--keep-fp8"] if args.keep_fp8 else [])])
        row = {"size": tag, "layers": hf_cfg["num_hidden_layers"], "experts": hf_cfg["n_routed_experts"],
               "source_MB": src_bytes / 1e6, "out_MB": _folder_bytes(ckpt) / 1e6, "seconds": wall,
               "MB_per_s": src_bytes / 1e6 / wall, "peak_rss_MB": rss / 1e6}
        if args.to_hf:
            shutil.rmtree(back, ignore_errors=True)
            wall, rss = run_measured([sys.executable, "-m", "dsv3_jax.convert", "--to-hf", "--ckpt", ckpt,
                                      "--out", back, "--no-progress", *(["--fp8"] if args.fp8 else [])])
            row.update(export_seconds=wall, export_MB_per_s=_folder_bytes(back) / 1e6 / wall,
                       export_peak_rss_MB=rss / 1e6)
            if not args.keep:
                shutil.rmtree(back, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    small, large = rows[0]["peak_rss_MB"], rows[-1]["peak_rss_MB"]
    ok = large <= 1.25 * small and large < 2000
    print(f"peak RSS {small:.0f} MB -> {large:.0f} MB ({large / small - 1:+.0%}); "
          f"criteria (<= +25%, < 2000 MB): {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

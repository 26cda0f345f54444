"""Quantized loading: parameter bytes and peak RSS of `load_pretrained(weights=...)` on a synthetic
FP8 HF folder (the released format), each load in its own process, side by side with the bf16 load.

    python -m benchmarks.bench_quant_load [--workdir /tmp/dsv3_qload] [--size-gb 0.5] [--keep]

Prints, per format (bf16, fp8, int8 experts, int4 experts, int4 all; int groups of 64 rows): the bytes of the arrays the
model holds, the load's peak RSS less the RSS before it (the devices are host memory on CPU, so
this is what the model holds plus staging), and both as ratios to the bf16 load. A load that made
a bf16 copy of a quantized weight would show it as peak above held bytes by a leaf's bf16 size;
`fp8` reads the stored e4m3 windows and their scales and dequantises nothing.

    python -m benchmarks.bench_quant_load worker HF_DIR OUT WEIGHTS QUANTIZE
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from absl import flags

from benchmarks.bench_load import _rss  # VmHWM / VmRSS of this process, bytes
from dsv3_jax import cli

LOADS = [("bf16", "none", "none"), ("fp8", "fp8", "all"), ("int8 experts", "int8", "experts"),
         ("int4 experts", "int4", "experts"), ("int4 all", "int4", "all")]


GROUP = 64  # divides every contraction of the bench config (q_lora_rank 192)


def worker(hf_dir: str, out: str, weights: str, quantize: str) -> None:
    import jax
    from flax import nnx

    from dsv3_jax.checkpoint import load_pretrained

    before = _rss("VmRSS")
    kw = {} if weights == "none" else dict(weights=weights, quantize=quantize, quant_group=GROUP)
    model = load_pretrained(hf_dir, progress=False, **kw)
    held = sum(a.nbytes for a in jax.tree.leaves(nnx.state(model)))
    with open(out, "w") as f:
        json.dump({"held_bytes": held, "peak_load_bytes": _rss("VmHWM") - before}, f)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("workdir", "/tmp/dsv3_qload", "where the synthetic folder and the reports go", flag_values=fv)
    flags.DEFINE_float("size-gb", 0.5, "GB of tensors in the synthetic folder (bf16)", flag_values=fv)
    flags.DEFINE_boolean("keep", False, "keep the synthetic folder", flag_values=fv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # the loads' own processes: worker HF_DIR OUT WEIGHTS QUANTIZE
        worker(*argv[1:5])
        return 0
    args = cli.parse(define_flags, argv, __doc__)
    from benchmarks.make_synthetic_checkpoint import bench_config, layers_for_size, make_checkpoint

    folder = os.path.join(args.workdir, "fp8")
    if not os.path.exists(os.path.join(folder, "config.json")):
        make_checkpoint(bench_config(layers_for_size(args.size_gb * 1e9)), folder, use_fp8=True)
    rows = {}
    for name, weights, quantize in LOADS:
        out = os.path.join(args.workdir, f"{weights}_{quantize}.json")
        subprocess.run([sys.executable, "-m", "benchmarks.bench_quant_load", "worker", folder, out, weights, quantize],
                       check=True)
        with open(out) as f:
            rows[name] = json.load(f)
    base = rows["bf16"]
    print(f"{'weights':<14}{'held GB':>9}{'peak GB':>9}{'held/bf16':>11}{'peak/bf16':>11}{'peak/held':>11}")
    for name, r in rows.items():
        print(f"{name:<14}{r['held_bytes'] / 1e9:>9.3f}{r['peak_load_bytes'] / 1e9:>9.3f}"
              f"{r['held_bytes'] / base['held_bytes']:>11.3f}{r['peak_load_bytes'] / base['peak_load_bytes']:>11.3f}"
              f"{r['peak_load_bytes'] / r['held_bytes']:>11.3f}")
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

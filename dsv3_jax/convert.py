"""HF DeepSeek-V3 safetensors <-> our Orbax checkpoint.

    python -m dsv3_jax.convert --hf-dir HF --out CKPT [--dtype bfloat16|float32] [--keep-fp8] [--verify [N]]
    python -m dsv3_jax.convert --hf-dir HF --out CKPT --quantize fp8|int8|int4 [--quant-targets experts|all] \
        [--quant-group 128]
    python -m dsv3_jax.convert --to-hf --ckpt CKPT --out HF [--fp8] [--dtype ...] [--shard-size 5GB]
    python -m dsv3_jax.convert --to-hf --ckpt LORA_RUN --out PEFT --adapter_only [--base HF]

A LoRA run (experiments/configs/lora.py) exports merged (W + s A B) by default; `--adapter_only`
writes its adapters alone as a PEFT folder for transformers' DeepseekV3 (non-expert targets).

Streams: resident memory is about one layer slice whatever the checkpoint size. Output goes to a
temporary folder renamed into place only when complete. Exit code 0 on success, 2 with one line on
a checkpoint, config or I/O error (naming the tensor, file or path, e.g. of a full disk), 1 on
anything else.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    t = text.strip().upper()
    num = t.rstrip("KMGTB")
    return int(float(num) * units[t[len(num):]])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dsv3_jax.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", help="HF folder to read (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                   help="parameter dtype (default: as stored; bfloat16 for FP8 sources)")
    p.add_argument("--keep-fp8", action="store_true",
                   help="store FP8 projections as e4m3 + block scales (the `fp8` item) instead of dequantising")
    p.add_argument("--quantize", choices=["fp8", "int8", "int4"], default=None,
                   help="store projections quantized (fp8: e4m3 + 128x128 scales; int8/int4: a scale per "
                        "--quant-group rows); load_pretrained then loads them quantized")
    p.add_argument("--quant-targets", choices=["experts", "all"], default=None,
                   help="with --quantize: the routed experts or every projection (default: all for fp8, else experts)")
    p.add_argument("--quant-group", type=int, default=128, help="with --quantize=int8|int4: contraction rows per scale")
    p.add_argument("--verify", nargs="?", type=int, const=16, default=0, metavar="N",
                   help="re-read N sampled slices (default 16) and compare them with the source before committing")
    p.add_argument("--to-hf", action="store_true", help="export an Orbax checkpoint to an HF folder")
    p.add_argument("--ckpt", help="Orbax checkpoint, training run folder or run step folder to export (with --to-hf)")
    p.add_argument("--fp8", action="store_true", help="with --to-hf: write e4m3 projections + weight_scale_inv")
    p.add_argument("--shard-size", type=_size, default="5GB", help="with --to-hf: max bytes per shard")
    p.add_argument("--adapter_only", action="store_true",
                   help="with --to-hf on a LoRA run: write the adapters as a PEFT folder, not merged weights")
    p.add_argument("--base", help="with --adapter_only: base_model_name_or_path recorded in adapter_config.json")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (only once complete)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.to_hf and not args.ckpt:
        p.error("--to-hf needs --ckpt")
    if not args.to_hf and not args.hf_dir:
        p.error("--hf-dir is required (or --to-hf --ckpt CKPT)")
    if args.to_hf and (args.keep_fp8 or args.verify):
        p.error("--keep-fp8 and --verify apply to HF -> Orbax only")
    if args.adapter_only and not args.to_hf:
        p.error("--adapter_only applies to --to-hf --ckpt LORA_RUN")
    if args.to_hf and args.quantize:
        p.error("--quantize applies to HF -> Orbax only")
    if args.quant_group <= 0:
        p.error(f"--quant-group={args.quant_group} must be positive")
    if not args.to_hf and args.fp8:
        p.error("--fp8 applies to --to-hf; for HF -> Orbax use --keep-fp8")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from dsv3_jax import cli
    from dsv3_jax.checkpoint import CheckpointError

    try:
        if args.to_hf:
            from dsv3_jax.checkpoint import lora_export, run_folder
            from dsv3_jax.checkpoint.orbax_to_hf import convert_orbax_to_hf, export_run

            kw = dict(fp8_out=args.fp8, dtype=args.dtype, shard_bytes=args.shard_size, progress=not args.no_progress,
                      overwrite=args.overwrite)
            run = run_folder.find(args.ckpt)  # a training run's folder or step: exported with its tokenizer
            if args.adapter_only:
                if run is None:
                    raise CheckpointError(f"--adapter_only needs a LoRA training run's folder; {args.ckpt} is none")
                summary = lora_export.export_adapter(run, args.out, overwrite=args.overwrite, base=args.base)
                logging.info("wrote %s", summary)
                return 0
            summary = export_run(run, args.out, **kw) if run else convert_orbax_to_hf(args.ckpt, args.out, **kw)
        else:
            from dsv3_jax.checkpoint.hf_to_orbax import convert_hf_to_orbax

            summary = convert_hf_to_orbax(args.hf_dir, args.out, dtype=args.dtype, keep_fp8=args.keep_fp8,
                                          verify=args.verify, progress=not args.no_progress,
                                          overwrite=args.overwrite, quantize=args.quantize,
                                          quant_targets=args.quant_targets, quant_group=args.quant_group)
    except (ValueError, OSError) as e:
        return cli.fail(e, args.out)
    logging.info("wrote %s", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

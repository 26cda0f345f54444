"""HF DeepSeek-V3 safetensors <-> our Orbax checkpoint.

    python -m dsv3_jax.convert --hf-dir HF --out CKPT [--dtype bfloat16|float32] [--keep-fp8] [--verify[=N]]
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

import logging

from absl import flags

from dsv3_jax import cli


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    t = text.strip().upper()
    num = t.rstrip("KMGTB")
    return int(float(num) * units[t[len(num):]])


class _VerifyParser(flags.ArgumentParser):
    """`--verify` alone: 16 slices; `--verify=N`: N; `--noverify`: none."""

    def parse(self, argument: str) -> int:
        named = {"true": 16, "false": 0}
        if argument.lower() in named:
            return named[argument.lower()]
        if not argument.isdigit():
            raise ValueError(f"{argument!r} is not a number of slices")
        return int(argument)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("hf-dir", None, "HF folder to read (config.json + safetensors)", flag_values=fv)
    flags.DEFINE_string("out", None, "output folder (must not exist unless --overwrite)", required=True,
                        flag_values=fv)
    flags.DEFINE_enum("dtype", None, ["bfloat16", "float32", "float16"],
                      "parameter dtype (default: as stored; bfloat16 for FP8 sources)", flag_values=fv)
    flags.DEFINE_boolean("keep-fp8", False, "store FP8 projections as e4m3 + block scales (the `fp8` item) "
                         "instead of dequantising", flag_values=fv)
    flags.DEFINE_enum("quantize", None, ["fp8", "int8", "int4"],
                      "store projections quantized (fp8: e4m3 + 128x128 scales; int8/int4: a scale per "
                      "--quant-group rows); load_pretrained then loads them quantized", flag_values=fv)
    flags.DEFINE_enum("quant-targets", None, ["experts", "all"], "with --quantize: the routed experts or every "
                      "projection (default: all for fp8, else experts)", flag_values=fv)
    flags.DEFINE_integer("quant-group", 128, "with --quantize=int8|int4: contraction rows per scale", flag_values=fv)
    flags.DEFINE_flag(flags.Flag(_VerifyParser(), flags.ArgumentSerializer(), "verify", "0",
                                 "re-read N sampled slices (--verify alone: 16) and compare them with the source "
                                 "before committing", boolean=True), fv)
    flags.DEFINE_boolean("to-hf", False, "export an Orbax checkpoint to an HF folder", flag_values=fv)
    flags.DEFINE_string("ckpt", None, "Orbax checkpoint, training run folder or run step folder to export "
                        "(with --to-hf)", flag_values=fv)
    flags.DEFINE_boolean("fp8", False, "with --to-hf: write e4m3 projections + weight_scale_inv", flag_values=fv)
    flags.DEFINE_string("shard-size", "5GB", "with --to-hf: max bytes per shard (e.g. 5GB, 500MB)", flag_values=fv)
    flags.DEFINE_boolean("adapter_only", False, "with --to-hf on a LoRA run: write the adapters as a PEFT folder, "
                         "not merged weights", flag_values=fv)
    flags.DEFINE_string("base", None, "with --adapter_only: base_model_name_or_path recorded in "
                        "adapter_config.json", flag_values=fv)
    flags.DEFINE_boolean("overwrite", False, "replace --out if it exists (only once complete)", flag_values=fv)
    flags.DEFINE_boolean("no-progress", False, "no progress bar", flag_values=fv)


def parse_args(argv=None):
    args = cli.parse(define_flags, argv, __doc__)
    if args.to_hf and not args.ckpt:
        cli.usage("--to-hf needs --ckpt")
    if not args.to_hf and not args.hf_dir:
        cli.usage("--hf-dir is required (or --to-hf --ckpt CKPT)")
    if args.to_hf and (args.keep_fp8 or args.verify):
        cli.usage("--keep-fp8 and --verify apply to HF -> Orbax only")
    if args.adapter_only and not args.to_hf:
        cli.usage("--adapter_only applies to --to-hf --ckpt LORA_RUN")
    if args.to_hf and args.quantize:
        cli.usage("--quantize applies to HF -> Orbax only")
    if args.quant_group <= 0:
        cli.usage(f"--quant-group={args.quant_group} must be positive")
    if not args.to_hf and args.fp8:
        cli.usage("--fp8 applies to --to-hf; for HF -> Orbax use --keep-fp8")
    try:
        args.shard_size = _size(args.shard_size)
    except (ValueError, KeyError):
        cli.usage(f"--shard-size={args.shard_size} is not a size such as 5GB or 500MB")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
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
    cli.exit_with(main())

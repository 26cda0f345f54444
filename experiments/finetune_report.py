"""One line per fine-tuning run: what it cost and what it changed, measured on its own files.

    python -m experiments.finetune_report --runs=runs/sft[,runs/lora,...]

For each run folder (its latest checkpoint and metrics.jsonl):
  trainable   parameters the optimizer updates: the elements of Adam's first moments (`mu`) in the
              checkpoint's optimizer state, counted on the stored arrays
  of_total    all parameters of the model (`params` of the checkpoint)
  opt_bytes   bytes of every optimizer-state array in the checkpoint
  step_s      median seconds per step over the logged windows (tokens/step / tokens/s)
  sft_eval    held-out loss of the run's own (chat) data: at step 0 (the starting model) -> the last eval
  pretrain    held-out loss of the pretraining corpus (data.pretrain_eval): step 0 -> the last eval
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from dsv3_jax.checkpoint import CheckpointError, orbax_layout, run_folder


def checkpoint_sizes(step_dir: str) -> dict[str, int]:
    """{"trainable", "of_total", "opt_bytes"} from the shapes and dtypes of the stored arrays."""
    reader = orbax_layout.ItemReader(step_dir, "state")
    out = {"trainable": 0, "of_total": 0, "opt_bytes": 0}
    for key in orbax_layout.item_keys(step_dir, "state"):
        try:
            array = reader.array(key)
        except CheckpointError:  # an empty optimizer state (optax's EmptyState) stores no array
            continue
        count = int(np.prod(array.shape, dtype=np.int64))
        if key[0] == "params":
            out["of_total"] += count
        elif key[0] == "opt_state":
            out["opt_bytes"] += count * np.dtype(array.dtype.numpy_dtype).itemsize
            out["trainable"] += count if "mu" in key else 0
    return out


def metrics_summary(run_dir: str, skip_first: bool = False) -> dict[str, float]:
    """Median step time (without the first logged window, which holds the compile, when
    `skip_first` and there are others) and (first, last) of each held-out loss."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(run_dir, "config.json")) as f:
        data = json.load(f)["data"]
    tokens_per_step = data["batch_size"] * data["seq_len"]
    windows = [tokens_per_step / r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    out = {"step_s": float(np.median(windows[1:] if skip_first and len(windows) > 1 else windows))}
    for key, name in (("eval_loss", "sft_eval"), ("pretrain_eval_loss", "pretrain")):
        points = [r[key] for r in records if key in r]
        if points:
            out[name] = (points[0], points[-1])
    return out


def report(run_path: str) -> str:
    run = run_folder.find(run_path)
    if run is None:
        raise SystemExit(f"{run_path} is not a training run folder")
    sizes, m = checkpoint_sizes(run.step_dir), metrics_summary(run.run_dir)
    parts = [f"{run_path} (step {run.step})", f"trainable {sizes['trainable']:,} of {sizes['of_total']:,}",
             f"opt_bytes {sizes['opt_bytes']:,}", f"step_s {m['step_s']:.3f}"]
    for name in ("sft_eval", "pretrain"):
        if name in m:
            parts.append(f"{name} {m[name][0]:.4f} -> {m[name][1]:.4f}")
    return " | ".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help="comma-separated run folders")
    args = parser.parse_args(argv)
    for path in args.runs.split(","):
        print(report(path), flush=True)


if __name__ == "__main__":
    main()

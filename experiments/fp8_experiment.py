"""BF16 against the full FP8 recipe (DeepSeek-V3 section 3.3): same data, seed and schedule.

    python -m experiments.fp8_experiment --runs=runs/fp8 --train_steps=300         # both runs, then the plot
    python -m experiments.fp8_experiment --runs=runs/fp8 --only=fp8          # one run (run both in parallel)
    python -m experiments.fp8_experiment --runs=runs/fp8 --plot_only --png=docs/fp8_loss.png

The model is the tiny training preset with every matmul width a multiple of 128 (the FP8 tiles),
on 8 x 64-token rows a step;
`bf16` computes in bfloat16 with fp32 AdamW moments, `fp8` adds `fp8_matmul=True` (Fprop, Dgrad
and Wgrad in FP8, FP8 residuals) and bf16 moments. Prints the mean training loss of the last
`--window` steps of each and their relative difference (the paper reports < 0.25%), and writes
both curves to a PNG.
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags

_RUNS = flags.DEFINE_string("runs", "runs/fp8", "Folder of the two runs (bf16/, fp8/).")
_STEPS = flags.DEFINE_integer("train_steps", 300, "Train steps of each run.")
_WINDOW = flags.DEFINE_integer("window", 50, "Steps at the end whose mean loss is compared.")
_ONLY = flags.DEFINE_enum("only", None, ["bf16", "fp8"], "Run just this one.")
_PLOT_ONLY = flags.DEFINE_bool("plot_only", False, "Read the two runs' metrics; train nothing.")
_PNG = flags.DEFINE_string("png", "docs/fp8_loss.png", "Where the two curves go.")

# Widths of the tiny preset raised to multiples of 128 where they feed an FP8 GEMM.
MODEL = dict(compute_dtype="bfloat16", moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128)
RECIPES = {
    "bf16": dict(model=dict(fp8_matmul=False), moment_dtype="float32"),
    "fp8": dict(model=dict(fp8_matmul=True), moment_dtype="bfloat16"),
}


def run_config(name: str, workdir: str, steps: int):
    from experiments.configs import tiny

    c = tiny.get_config()
    c.model.update({**MODEL, **RECIPES[name]["model"]})
    c.optimizer.moment_dtype = RECIPES[name]["moment_dtype"]
    c.data.seq_len, c.data.batch_size = 64, 8  # 512 tokens a step: 300 steps fit a shared 2-core machine
    c.train.workdir = os.path.join(workdir, name)
    c.train.steps = steps
    c.train.log_every = 1  # a loss for every step
    c.train.eval_every = steps  # one eval at the end
    c.train.checkpoint_every = steps
    return c


def losses(workdir: str, name: str) -> np.ndarray:
    from dsv3_jax.train.metrics import read_metrics

    records = read_metrics(os.path.join(workdir, name))
    return np.array([r["loss"] for r in sorted(records, key=lambda r: r["step"]) if "loss" in r])


def compare(workdir: str, window: int) -> dict:
    curves = {name: losses(workdir, name) for name in RECIPES}
    n = min(len(c) for c in curves.values())
    if n < window:
        raise SystemExit(f"need {window} logged steps in both runs under {workdir}; have {n}")
    means = {name: float(np.mean(c[n - window:n])) for name, c in curves.items()}
    rel = abs(means["fp8"] - means["bf16"]) / means["bf16"]
    return dict(curves=curves, steps=n, means=means, relative_difference=rel)


def plot(result: dict, window: int, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in result["curves"].items():
        ax.plot(np.arange(1, len(curve) + 1), curve, label=f"{name} (last {window}: {result['means'][name]:.4f})",
                lw=1)
    ax.axvspan(result["steps"] - window, result["steps"], color="0.9")
    ax.set(xlabel="step", ylabel="training loss (lm + MTP + balance)", yscale="log",
           title=f"BF16 vs FP8 recipe: relative difference {100 * result['relative_difference']:.3f}%")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=120)


def main(argv):
    del argv
    if not _PLOT_ONLY.value:
        from experiments.train import train

        for name in [_ONLY.value] if _ONLY.value else list(RECIPES):
            train(run_config(name, _RUNS.value, _STEPS.value))
        if _ONLY.value:
            return
    result = compare(_RUNS.value, _WINDOW.value)
    plot(result, _WINDOW.value, _PNG.value)
    print(f"steps {result['steps']}, mean loss over the last {_WINDOW.value}: bf16 {result['means']['bf16']:.5f}, "
          f"fp8 {result['means']['fp8']:.5f}, relative difference {100 * result['relative_difference']:.4f}% "
          f"(paper: < 0.25%); curves in {_PNG.value}")


if __name__ == "__main__":
    app.run(main)

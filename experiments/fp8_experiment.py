"""BF16 against the full FP8 recipe (DeepSeek-V3 section 3.3): same data, seed and schedule.

    python -m experiments.fp8_experiment --runs=runs/fp8_800 --arms=bf16,bf16_tile64,fp8 --batch=16 \
        --seq_len=128 --train_steps=800                      # docs/fp8.md's 800-step runs and PNG
    python -m experiments.fp8_experiment --runs=runs/fp8 --arms=bf16,fp8,fp32 --batch=16 --seq_len=128 \
        --train_steps=300 --cross_eval=8                     # its 300-step runs
    python -m experiments.fp8_experiment --runs=runs/fp8_800 --plot_only --png=docs/fp8_loss.png

The model is the tiny training preset with every matmul width a multiple of 128 (the FP8 tiles),
on `--batch` x `--seq_len`-token rows a step, with the preset's schedule over `--train_steps`.
`bf16` computes in bfloat16 with fp32 AdamW moments, `fp8` adds `fp8_matmul=True` (Fprop, Dgrad
and Wgrad in FP8, FP8 residuals) and bf16 moments, `fp32` computes in fp32 (the full-precision
reference), `bf16_moments` is bf16 with only the moments changed, `bf16_tile64` is bf16 with the
expert-gradient sums in another order (a rounding-only twin). Prints the mean training loss
(and lm loss) of the last `--window` steps of each run and its signed difference relative to
bf16 (the paper reports < 0.25%), writes the curves to a PNG, and with `--cross_eval` evaluates
each run's final weights under each arm's forward.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

_RUNS = flags.DEFINE_string("runs", "runs/fp8", "Folder of the two runs (bf16/, fp8/).")
_STEPS = flags.DEFINE_integer("train_steps", 300, "Train steps of each run.")
_WINDOW = flags.DEFINE_integer("window", 50, "Steps at the end whose mean loss is compared.")
_ARMS = flags.DEFINE_list("arms", "bf16,fp8", "Runs to train, one after the other (keys of RECIPES).")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Tokens per row.")
_SEED = flags.DEFINE_integer("seed", 0, "Init and data seed of every arm.")
_PLOT_ONLY = flags.DEFINE_bool("plot_only", False, "Read the runs' metrics; train nothing.")
_PNG = flags.DEFINE_string("png", "docs/fp8_loss.png", "Where the two curves go.")
_CROSS_EVAL = flags.DEFINE_integer("cross_eval", 0, "Held-out batches on which to evaluate each run's final "
                                   "weights under each arm's forward (0: skip).")
_MEMORY = flags.DEFINE_bool("memory", False, "Print the bytes saved for backward per MoE layer (bf16 vs FP8 "
                            "caching) and the optimizer-state bytes (fp32 vs bf16 moments); train nothing.")

# Widths of the tiny preset raised to multiples of 128 where they feed an FP8 GEMM.
MODEL = dict(compute_dtype="bfloat16", moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128)
RECIPES = {
    "bf16": dict(model=dict(fp8_matmul=False), moment_dtype="float32"),
    # Everything in fp32: which of bf16 and fp8 lands nearer full precision.
    "fp32": dict(model=dict(compute_dtype="float32"), moment_dtype="float32"),
    "fp8": dict(model=dict(fp8_matmul=True), moment_dtype="bfloat16"),
    # bf16 with only the moments changed: how far a small numeric change moves the last-50 mean.
    "bf16_moments": dict(model=dict(fp8_matmul=False), moment_dtype="bfloat16"),
    # bf16 with 64-row expert tiles: the same formula with the expert-gradient sums in another
    # order (255 gradient entries differ by one ulp at init), so a rounding-only twin of bf16.
    "bf16_tile64": dict(model=dict(fp8_matmul=False, moe_tile_size=64), moment_dtype="float32"),
}
COMPARED = ("bf16", "fp8")  # the claim; every other arm is reported when its run exists


def run_config(name: str, workdir: str, steps: int, batch: int = 8, seq_len: int = 64, seed: int = 0):
    from experiments.configs import tiny

    c = tiny.get_config()
    c.model.update({**MODEL, **RECIPES[name]["model"]})
    c.optimizer.moment_dtype = RECIPES[name]["moment_dtype"]
    c.data.seq_len, c.data.batch_size = seq_len, batch
    c.train.seed = c.data.seed = seed
    c.train.workdir = os.path.join(workdir, name)
    c.train.steps = steps
    c.train.log_every = 1  # a loss for every step
    c.train.eval_every = steps  # one eval at the end
    c.train.checkpoint_every = steps
    return c


def losses(workdir: str, name: str, key: str = "loss") -> np.ndarray:
    """Per-step `key` (the training loss: lm + MTP + balance; or `lm_loss`) of one run, in step order."""
    from dsv3_jax.train.metrics import read_metrics

    records = read_metrics(os.path.join(workdir, name))
    return np.array([r[key] for r in sorted(records, key=lambda r: r["step"]) if key in r])


def compare(workdir: str, window: int, key: str = "loss") -> dict:
    """Mean `key` over the last `window` steps of every run under `workdir`, and each one's signed
    difference relative to bf16 ((run - bf16) / bf16)."""
    names = [name for name in RECIPES if name in COMPARED or os.path.isdir(os.path.join(workdir, name))]
    curves = {name: losses(workdir, name, key) for name in names}
    n = min(len(c) for c in curves.values())
    if n < window:
        raise SystemExit(f"need {window} logged steps in each run under {workdir}; have {n}")
    means = {name: float(np.mean(c[n - window:n])) for name, c in curves.items()}
    rel = {name: (m - means["bf16"]) / means["bf16"] for name, m in means.items() if name != "bf16"}
    return dict(curves=curves, steps=n, means=means, relative_difference=rel)


def cross_eval(workdir: str, max_batches: int) -> dict:
    """Held-out loss of each run's final weights under each arm's forward: {(weights, forward): loss}.

    Separates "these weights are better" (a row lower under every forward) from "this forward
    reads a lower loss" (a column lower for every row's weights)."""
    from flax import nnx

    from dsv3_jax import load_pretrained
    from dsv3_jax.train import losses as losses_lib
    from experiments.train import make_data

    @nnx.jit
    def nll(model, batch):
        inputs, targets, mask = losses_lib.inputs_and_targets(batch)
        t = inputs.shape[1]
        out = model.forward(inputs, positions=batch["positions"][:, :t], segment_ids=batch["segment_ids"][:, :t],
                            with_mtp=False)
        return losses_lib.cross_entropy(out.logits, targets, mask)

    names = [n for n in RECIPES if os.path.isdir(os.path.join(workdir, n, "checkpoints"))]
    with open(os.path.join(workdir, names[0], "config.json")) as f:
        data = json.load(f)["data"]
    c = run_config(names[0], workdir, 1, data["batch_size"], data["seq_len"], data.get("seed", 0))  # the runs' split
    batches = [b for _, b in zip(range(max_batches), make_data(c, c.model.vocab_size)[1])]
    table = {}
    for weights in names:
        for forward in names:
            policy = {"compute_dtype": MODEL["compute_dtype"], "fp8_matmul": False, **RECIPES[forward]["model"]}
            model = load_pretrained(os.path.join(workdir, weights), **policy)
            sums = [nll(model, b) for b in batches]
            table[weights, forward] = sum(float(s) for s, _ in sums) / sum(float(n) for _, n in sums)
    return table


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
           title=f"BF16 vs FP8 recipe: FP8 relative to BF16 {100 * result['relative_difference']['fp8']:+.3f}%")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=120)


def saved_for_backward(model_overrides: dict, num_layers: int, tokens: int) -> tuple[int, int]:
    """(bytes, bytes of which FP8) the backward keeps: outputs of `jax.vjp`'s forward in the jaxpr
    that are not parameters passed straight through (those are held anyway)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv3_jax import DeepSeekV3
    from experiments.train import model_config

    c = run_config("bf16", "", 1)
    c.model.update({**model_overrides, "num_layers": num_layers})
    model = nnx.eval_shape(lambda: DeepSeekV3(model_config(c), rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens_BxT = jax.ShapeDtypeStruct((tokens // c.data.seq_len, c.data.seq_len), jnp.int32)

    def loss(p, r, t):
        return jnp.mean(nnx.merge(graphdef, p, r).forward(t).logits.astype(jnp.float32) ** 2)

    vjp = lambda p, r, t: jax.vjp(lambda q, b: loss(q, b, t), p, r)[1]  # noqa: E731 (nnx: one trace level)
    closed = jax.make_jaxpr(vjp)(params, rest, tokens_BxT)
    inputs = set(map(id, closed.jaxpr.invars))
    saved = [v.aval for v in closed.jaxpr.outvars if id(v) not in inputs and hasattr(v, "aval")]
    size = lambda a: a.size * a.dtype.itemsize  # noqa: E731
    return sum(map(size, saved)), sum(size(a) for a in saved if a.dtype == jnp.float8_e4m3fn)


def optimizer_bytes(moment_dtype: str) -> int:
    import jax
    from flax import nnx

    from dsv3_jax import DeepSeekV3
    from dsv3_jax.train import optimizer as optimizer_lib
    from experiments.train import model_config

    c = run_config("fp8", "", 1)
    c.optimizer.moment_dtype = moment_dtype
    params = nnx.eval_shape(lambda: nnx.state(DeepSeekV3(model_config(c), rngs=nnx.Rngs(0)), nnx.Param))
    pure = nnx.to_pure_dict(params)
    tx = optimizer_lib.make_optimizer(c.optimizer, 10, jax.tree.map(lambda _: True, pure))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(jax.eval_shape(tx.init, pure)))


def print_memory() -> None:
    """One MoE layer = the model with 3 layers minus the model with 2 (1 dense layer in both)."""
    tokens = 8 * 64
    # bf16 with ragged_dot, the TPU/GPU default: the CPU tiled path also saves gathered weight tiles.
    for name, overrides in (("bf16", dict(moe_impl="ragged")), ("fp8", dict(fp8_matmul=True))):
        (b3, f3), (b2, f2) = (saved_for_backward(overrides, n, tokens) for n in (3, 2))
        print(f"{name}: saved for backward per MoE layer, {tokens} tokens: {b3 - b2:,} bytes "
              f"({f3 - f2:,} of them FP8); whole 3-layer model {b3:,}")
    b32, b16 = optimizer_bytes("float32"), optimizer_bytes("bfloat16")
    print(f"optimizer state: fp32 moments {b32:,} bytes, bf16 moments {b16:,} bytes ({b16 / b32:.3f}x)")


def main(argv):
    del argv
    if _MEMORY.value:
        print_memory()
        return
    if not _PLOT_ONLY.value:
        from experiments.train import train

        for name in _ARMS.value:
            if name not in RECIPES:
                raise app.UsageError(f"--arms: unknown arm {name!r}; choose from {sorted(RECIPES)}")
            train(run_config(name, _RUNS.value, _STEPS.value, _BATCH.value, _SEQ_LEN.value, _SEED.value))
    result = compare(_RUNS.value, _WINDOW.value)
    plot(result, _WINDOW.value, _PNG.value)
    for key, what in (("loss", "training loss (lm + MTP + balance)"), ("lm_loss", "lm loss")):
        r = compare(_RUNS.value, _WINDOW.value, key)
        print(f"steps {r['steps']}, mean {what} over the last {_WINDOW.value}: "
              + ", ".join(f"{name} {m:.5f}" for name, m in r["means"].items()) + "; relative to bf16: "
              + ", ".join(f"{name} {100 * d:+.4f}%" for name, d in r["relative_difference"].items()))
    print(f"paper: FP8 within 0.25% of BF16; curves in {_PNG.value}")
    if _CROSS_EVAL.value:
        for (weights, forward), loss in cross_eval(_RUNS.value, _CROSS_EVAL.value).items():
            print(f"held-out loss, {weights} weights, {forward} forward: {loss:.5f}")

if __name__ == "__main__":
    app.run(main)

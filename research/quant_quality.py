"""Quality of quantized weights and latent caches against the unquantized model (docs/quantization.md).

    python -m research.quant_quality --workdir=runs/quant_quality --train_steps=400   # train, then measure
    python -m research.quant_quality --checkpoint=runs/tiny                           # an existing run

With --train_steps the run is trained (or resumed, or found finished) by `python -m experiments.train`
(its default tiny preset unless --train_config; more overrides through --train_flag), evaluating
every --eval_every steps. The run's eval-loss curve is printed with the flatness criterion: the best
eval loss of the last --flat_k evals improves on the best before them by less than --flat_tol
(relative). Then, on the run's held-out split (the one its eval loss reads), in fp32 compute:

- weight arms, `load_pretrained(run, weights=, quantize=, quant_group=)`: the full forward's
  perplexity and mean per-token KL(unquantized || arm) over the held-out targets;
- cache arms, unquantized weights with `cache_dtype`: every whole held-out row read as one stream
  through the latent cache, its first --cache_prefill tokens in one prefill step and the rest one
  decode step each; the perplexity and KL(fp32 cache || arm) at the same positions (the fp32-cache
  row's own KL: to the full forward over the same rows, the absorbed-vs-expanded difference);
- every arm: greedy generation (the `Generation` loop experiments.generate runs) of --new_tokens
  after each of --prompts prompts (the first --prompt_len tokens of whole held-out rows);
  agreement = share of generated tokens equal to the unquantized model's (fp32 cache) at the same
  index, and how many prompts' continuations are identical throughout.

Prints progress lines (rate, ETA), then a markdown table; --json writes the figures. Bad flags: one
line naming the flag, exit code 2.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags
from flax import nnx

from dsv3_jax import CheckpointError, cli, load_pretrained, paths
from dsv3_jax.checkpoint import run_folder
from dsv3_jax.inference import Generation, bucket_slots, init_cache
from dsv3_jax.model.quant import parameter_bytes
from dsv3_jax.train.loop import make_data
from dsv3_jax.train.metrics import format_duration


def read_metrics(workdir: str) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    text = paths.at(paths.join(workdir, "metrics.jsonl")).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# name -> (load_pretrained's weights, quantize); "unquantized" is every arm's reference.
WEIGHT_ARMS = {
    "unquantized": (None, None),
    "fp8": ("fp8", "all"),
    "int8_experts": ("int8", "experts"),
    "int4_experts": ("int4", "experts"),
    "int4_all": ("int4", "all"),
}
# name -> cache_dtype, unquantized weights; "cache_float32" is the other cache arms' reference.
CACHE_ARMS = {"cache_float32": "float32", "cache_bfloat16": "bfloat16", "cache_float8": "float8",
              "cache_int8": "int8"}
ARMS = (*WEIGHT_ARMS, *CACHE_ARMS)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("checkpoint", None, "a training run's folder (its config.json gives the held-out split)",
                        flag_values=fv)
    flags.DEFINE_string("workdir", None, "with --train_steps: the run folder experiments.train writes (or resumes)",
                        flag_values=fv)
    flags.DEFINE_integer("train_steps", None, "train the --workdir run to this many steps first", flag_values=fv)
    flags.DEFINE_string("train_config", None, "experiments.train --config (default: its tiny preset)", flag_values=fv)
    flags.DEFINE_multi_string("train_flag", [], "another experiments.train flag (repeatable)", flag_values=fv)
    flags.DEFINE_integer("eval_every", 20, "steps between the training run's eval losses", flag_values=fv)
    flags.DEFINE_integer("eval_batches", 5, "held-out batches (the training evals and the table; the bundled corpus "
                         "holds out 5)", flag_values=fv)
    flags.DEFINE_integer("flat_k", 3, "flatness: the last K evals ...", flag_values=fv)
    flags.DEFINE_float("flat_tol", 0.01, "... improve the best loss by less than this share", flag_values=fv)
    flags.DEFINE_string("arms", ",".join(ARMS), f"comma-separated subset of {','.join(ARMS)}", flag_values=fv)
    flags.DEFINE_integer("quant_group", 128, "int8/int4: rows of the contraction axis per scale", flag_values=fv)
    flags.DEFINE_integer("cache_prefill", 64, "cache arms: row tokens entering in one prefill step", flag_values=fv)
    flags.DEFINE_integer("prompts", 32, "greedy-generation prompts", flag_values=fv)
    flags.DEFINE_integer("prompt_len", 32, "tokens per prompt", flag_values=fv)
    flags.DEFINE_integer("new_tokens", 64, "greedy tokens generated per prompt", flag_values=fv)
    flags.DEFINE_string("json", None, "write the figures here", flag_values=fv)


def parse_args(argv=None):
    args = cli.parse(define_flags, argv, __doc__)
    if (args.checkpoint is None) == (args.workdir is None):
        cli.usage("pass one of --checkpoint=RUN or --workdir=RUN --train_steps=N")
    if (args.workdir is None) != (args.train_steps is None):
        cli.usage("--workdir and --train_steps go together (or pass --checkpoint=RUN)")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or set(arms) - set(ARMS):
        cli.usage(f"--arms {args.arms!r}: expected a comma-separated subset of {','.join(ARMS)}")
    args.arms = arms
    for flag in ("eval_every", "eval_batches", "flat_k", "quant_group", "cache_prefill", "prompts", "prompt_len",
                 "new_tokens", *(("train_steps",) if args.train_steps is not None else ())):
        if getattr(args, flag) < 1:
            cli.usage(f"--{flag}={getattr(args, flag)} must be positive")
    return args


# ---------------------------------------------------------------------------------------------------------
# The run: training, its eval curve, its held-out split

def train_command(args) -> list[str]:
    """The experiments.train command that trains (or resumes) the --workdir run."""
    config = [f"--config={args.train_config}"] if args.train_config else []  # absl reads --config first
    return [sys.executable, "-m", "experiments.train", *config, f"--workdir={args.workdir}",
            f"--steps={args.train_steps}",
            f"--config.train.eval_every={args.eval_every}", f"--config.train.eval_batches={args.eval_batches}",
            f"--config.train.checkpoint_every={max(args.train_steps // 4, 1)}", *args.train_flag]


def eval_curve(run_dir: str) -> list[tuple[int, float]]:
    """(step, eval loss) of every eval the run logged, in step order."""
    records = read_metrics(run_dir)
    return sorted((int(r["step"]), float(r["eval_loss"])) for r in records if "eval_loss" in r)


def flatness(curve: list[tuple[int, float]], k: int) -> float:
    """Relative improvement of the best of the last k eval losses over the best before them (nan when
    the curve has no more than k points)."""
    if len(curve) <= k:
        return float("nan")
    before, last = min(e for _, e in curve[:-k]), min(e for _, e in curve[-k:])
    return (before - last) / before


def heldout_batches(run_dir: str, vocab_size: int, max_batches: int) -> list[dict]:
    """The run's held-out batches ({tokens, segment_ids, positions} [B, T + 1]), as its evals read them."""
    with open(os.path.join(run_dir, "config.json")) as f:
        config = ml_collections.ConfigDict(json.load(f))
    eval_ds = make_data(config, vocab_size)[1]["eval_loss"]
    return [{k: np.asarray(v) for k, v in b.items()} for _, b in zip(range(max_batches), eval_ds)]


def whole_rows(batches: list[dict]) -> np.ndarray:
    """int32 [R, T + 1]: the held-out rows without padding, read as one token stream each."""
    return np.concatenate([b["tokens"][(b["segment_ids"] > 0).all(1)] for b in batches]).astype(np.int32)


# ---------------------------------------------------------------------------------------------------------
# Measurements

class Progress:
    """A line every `every` seconds: units done, rate and ETA over the whole measurement."""

    def __init__(self, total: int, every: float = 10.0):
        self.total, self.done, self.every = total, 0, every
        self.start = self.last = time.perf_counter()

    def tick(self, what: str, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every or self.done == self.total:
            rate = self.done / max(now - self.start, 1e-9)
            print(f"[{format_duration(now - self.start)}] {what}: {self.done}/{self.total} steps, {rate:.2f}/s, "
                  f"ETA {format_duration((self.total - self.done) / max(rate, 1e-9))}", flush=True)
            self.last = now


def _log_probs(logits):
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def full_forward(model):
    """(tokens, positions, segment_ids) [B, T] -> fp32 log-probabilities [B, T, V], the forward training runs."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, x, pos, seg: _log_probs(
        nnx.merge(graphdef, s).forward(x, positions=pos, segment_ids=seg, with_mtp=False).logits))
    return lambda x, pos=None, seg=None: step(state, x, pos, seg)


@jax.jit
def _score(logp_BxTxV, ref_BxTxV, targets_BxT, mask_BxT):
    """(summed NLL of the targets, summed KL(ref || logp), token count) over the mask."""
    m = mask_BxT.astype(jnp.float32)
    nll = -jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    kl = jnp.sum(jnp.exp(ref_BxTxV) * (ref_BxTxV - logp_BxTxV), axis=-1)
    return jnp.sum(nll * m), jnp.sum(kl * m), jnp.sum(m)


def targets_and_mask(batch: dict) -> tuple[np.ndarray, ...]:
    """Inputs, targets and mask [B, T] of a packed batch: a target counts inside its input's document."""
    tokens, seg = batch["tokens"], batch["segment_ids"]
    mask = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return tokens[:, :-1], tokens[:, 1:], mask


def cache_log_probs(model, rows_RxT: np.ndarray, prefill: int, cache_dtype: str, progress: Progress,
                    what: str) -> jax.Array:
    """fp32 log-probabilities [R, T, V]: the first `prefill` tokens of every row in one cached step, then
    one decode step per token, every step the model's forward with a cache."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(s, cache, tokens, positions):
        out = nnx.merge(graphdef, s).forward(tokens, positions=positions, with_mtp=False, cache=cache)
        return _log_probs(out.logits), out.cache

    rows = jnp.asarray(rows_RxT)
    positions = jnp.broadcast_to(jnp.arange(rows.shape[1], dtype=jnp.int32), rows.shape)
    cache = init_cache(model.config, rows.shape[0], bucket_slots(rows.shape[1]), cache_dtype)
    logp, cache = step(state, cache, rows[:, :prefill], positions[:, :prefill])
    pieces = [logp]
    progress.tick(what)
    for i in range(prefill, rows.shape[1]):
        logp, cache = step(state, cache, rows[:, i:i + 1], positions[:, i:i + 1])
        pieces.append(logp)
        progress.tick(what)
    return jnp.concatenate(pieces, axis=1)


def greedy(model, prompts_BxP: np.ndarray, new_tokens: int, cache_dtype: str, progress: Progress,
           what: str) -> np.ndarray:
    """int32 [B, new_tokens]: greedy continuations (no stop tokens), decoded as experiments.generate does."""
    gen = Generation(model, prompts_BxP, new_tokens, temperature=0.0, cache_dtype=cache_dtype)
    for _ in gen:
        progress.tick(what)
    return gen.output()[:, prompts_BxP.shape[1]:]


def _figures(totals, **fields) -> dict:
    """An arm's row from its (summed NLL, summed KL, token count) and the other fields."""
    nll, kl, count = (float(v) for v in totals)
    return dict(perplexity=math.exp(nll / count), kl=kl / count, tokens=int(count), **fields)


def weight_arm(model, batches: list[dict], ref_logps: list | None, progress: Progress, what: str):
    """(summed NLL, KL to `ref_logps` (None: to itself), tokens) of the full forward over `batches`, and
    its log-probabilities per batch."""
    forward, logps, totals = full_forward(model), [], np.zeros(3)
    for i, batch in enumerate(batches):
        x, y, mask = targets_and_mask(batch)
        logp = forward(jnp.asarray(x), jnp.asarray(batch["positions"][:, :-1]),
                       jnp.asarray(batch["segment_ids"][:, :-1]))
        totals += np.array(_score(logp, logp if ref_logps is None else ref_logps[i], jnp.asarray(y), jnp.asarray(mask)))
        logps.append(logp)
        progress.tick(what)
    return totals, logps


def measure(args, run: run_folder.RunStep, batches: list[dict]) -> dict[str, dict]:
    """Every asked-for arm's figures: perplexity, KL, its reference, agreement, identical prompts, bytes."""
    rows = whole_rows(batches)
    t = rows.shape[1] - 1
    if len(rows) < args.prompts:
        raise ValueError(f"--prompts={args.prompts}: the held-out split has {len(rows)} whole rows")
    if not args.prompt_len < t or not args.cache_prefill < t:
        raise ValueError(f"--prompt_len={args.prompt_len} and --cache_prefill={args.cache_prefill} must be below "
                         f"the rows' {t} tokens")
    prompts, stream, stream_targets = rows[:args.prompts, :args.prompt_len], rows[:, :-1], rows[:, 1:]
    weight_arms = ["unquantized"] + [a for a in args.arms if a in WEIGHT_ARMS and a != "unquantized"]
    cache_arms = [a for a in CACHE_ARMS if a in args.arms or a == "cache_float32" and set(args.arms) & set(CACHE_ARMS)]
    progress = Progress(len(weight_arms) * (len(batches) + args.new_tokens)
                        + len(cache_arms) * (1 + t - args.cache_prefill + args.new_tokens) + bool(cache_arms))
    results, ref_logps, ref_tokens = {}, None, None

    def agreement(tokens):
        same = tokens == ref_tokens
        return dict(agreement=float(same.mean()), identical_prompts=int(same.all(1).sum()))

    for arm in weight_arms:
        weights, quantize = WEIGHT_ARMS[arm]
        model = load_pretrained(run.step_dir, dtype=jnp.float32, weights=weights, quantize=quantize,
                                quant_group=args.quant_group)
        totals, logps = weight_arm(model, batches, ref_logps, progress, arm)
        tokens = greedy(model, prompts, args.new_tokens, "float32", progress, arm)
        if arm == "unquantized":
            ref_logps, ref_tokens, reference = logps, tokens, model
        results[arm] = _figures(totals, weights=weights or "fp32", quantize=quantize or "-", cache="float32",
                                bytes=parameter_bytes(model), kl_to="unquantized (full forward)", **agreement(tokens))
    if cache_arms:  # the full forward over the whole rows: the fp32 cache's reference
        stream_ref = full_forward(reference)(jnp.asarray(stream))
        progress.tick("full forward over whole rows")
    for arm in cache_arms:
        dtype = CACHE_ARMS[arm]
        logp = cache_log_probs(reference, stream, args.cache_prefill, dtype, progress, arm)
        totals = _score(logp, stream_ref, jnp.asarray(stream_targets), jnp.ones(stream_targets.shape, bool))
        if arm == "cache_float32":
            stream_ref = logp  # the other caches' reference
        tokens = greedy(reference, prompts, args.new_tokens, dtype, progress, arm)
        results[arm] = _figures(totals, weights="fp32", quantize="-", cache=dtype, bytes=parameter_bytes(reference),
                                kl_to="full forward" if arm == "cache_float32" else "fp32 cache", **agreement(tokens))
    return results


# ---------------------------------------------------------------------------------------------------------
# Report

def table(results: dict[str, dict], prompts: int, new_tokens: int) -> str:
    lines = ["| arm | weights | quantize | cache | held bytes (MB) | held-out ppl | mean KL (nats/token) | KL to | "
             f"greedy agreement ({new_tokens} tokens) | identical of {prompts} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in results.items():
        lines.append(f"| {arm} | {r['weights']} | {r['quantize']} | {r['cache']} | {r['bytes'] / 1e6:.2f} | "
                     f"{r['perplexity']:.4f} | {r['kl']:.3e} | {r['kl_to']} | {r['agreement']:.4f} | "
                     f"{r['identical_prompts']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.train_steps is not None:
        cmd = train_command(args)
        print("training:", " ".join(cmd[1:]), flush=True)
        if subprocess.run(cmd).returncode:
            print(f"error: training the run in --workdir={args.workdir} failed (its output is above)", file=sys.stderr)
            return 1
    path = args.checkpoint or args.workdir
    try:
        run = run_folder.find(path)
        if run is None or not os.path.isfile(os.path.join(run.run_dir, "config.json")):
            raise CheckpointError(f"--checkpoint={path} is not a training run's folder (its config.json names "
                                  f"the held-out split)")
        curve = eval_curve(run.run_dir)
        batches = heldout_batches(run.run_dir, run.model_config().vocab_size, args.eval_batches)
        rel = flatness(curve, args.flat_k)
        print(f"run {run.run_dir} at step {run.step}; eval loss (step: loss): "
              + ", ".join(f"{s}: {e:.4f}" for s, e in curve))
        print(f"flat: the best of the last {args.flat_k} evals improves on the best before by {100 * rel:.3f}% "
              f"(criterion < {100 * args.flat_tol:g}%): {'yes' if rel < args.flat_tol else 'NO'}", flush=True)
        results = measure(args, run, batches)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        return cli.fail(e)
    print(f"\n{results['unquantized']['tokens']} held-out target tokens, "
          f"quant_group={args.quant_group}, fp32 compute, cache rows prefilled {args.cache_prefill} then decoded\n")
    print(table(results, args.prompts, args.new_tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(run=run.run_dir, step=run.step, curve=curve, flat_relative_improvement=rel,
                           flat=bool(rel < args.flat_tol), arms=results), f, indent=2)
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

"""Base vs full fine-tuning vs LoRA (with and without the routed experts) from one pretrained run:
held-out loss, trainable parameters, optimizer-state bytes and step time, as a markdown table.

    python -m experiments.lora_figures --pretrained=RUN --out=runs/lora_figures [--arm_steps=100] [--data=chat.jsonl]

Every arm trains `--arm_steps` steps with experiments.train on the same data, seed and batches, from
the same checkpoint; "base" is the checkpoint's own held-out loss on those batches. Optimizer
bytes are measured on the arrays of each arm's train state; step time is the median over the
logged windows after the first (which holds the compile).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from absl import app, flags

from experiments import train as train_lib
from experiments.configs import lora as lora_config

_INIT = flags.DEFINE_string("pretrained", None, "pretrained run folder or HF folder (each arm's --init_from)")
_OUT = flags.DEFINE_string("out", "runs/lora_figures", "folder for the arms' runs and figures.md")
_STEPS = flags.DEFINE_integer("arm_steps", 100, "fine-tuning steps per arm")
_DATA = flags.DEFINE_string("data", None, "data glob for fine-tuning (default: the bundled corpus)")
_FULL_LR = flags.DEFINE_float("full_lr", 3e-4, "peak learning rate of the full fine-tune arm")

ARMS = ("full", "lora", "lora_experts")


def arm_config(arm: str, workdir: str):
    c = lora_config.get_config()
    with c.unlocked():
        if arm == "full":
            del c["lora"]
            c.optimizer.peak_lr, c.optimizer.end_lr = _FULL_LR.value, _FULL_LR.value / 10
        else:
            c.lora.experts = arm == "lora_experts"
        c.train.workdir, c.train.init_from, c.train.steps = workdir, _INIT.value, _STEPS.value
        c.train.eval_every, c.train.log_every = _STEPS.value, max(1, _STEPS.value // 10)
        c.train.checkpoint_every = _STEPS.value
        c.data.path = _DATA.value
    return c


def state_sizes(config) -> tuple[int, int]:
    """(trainable parameters, optimizer-state bytes) of the arm's train state, measured on arrays."""
    from dsv3_jax.train import finetune, optimizer as optimizer_lib, state as state_lib

    model = train_lib.build_model(config, train_lib.model_config(config))
    trainable = finetune.adapt(config, model)
    _, params, _ = state_lib.split_model(model)
    decay = optimizer_lib.select(optimizer_lib.decay_mask(params), trainable)
    tx = optimizer_lib.make_optimizer(config.optimizer, config.train.steps, decay)
    _, state = state_lib.init_train_state(model, tx, 0, trainable)
    count = sum(a.size for a in jax.tree.leaves(optimizer_lib.select(state.params, trainable)))
    return count, sum(a.nbytes for a in jax.tree.leaves(state.opt_state))


def base_eval(config) -> float:
    """The checkpoint's held-out loss on the arms' eval batches, before any fine-tuning step."""
    from dsv3_jax.train import state as state_lib, step as step_lib
    import optax

    model = train_lib.build_model(config, train_lib.model_config(config))
    _, eval_ds = train_lib.make_data(config, model.config.vocab_size)
    graphdef, state = state_lib.init_train_state(model, optax.identity(), 0)
    return train_lib.evaluate(step_lib.make_eval_step(graphdef), state, eval_ds, config.train.eval_batches)


def main(argv):
    del argv
    if not _INIT.value:
        raise app.UsageError("--pretrained=RUN_OR_HF is required")
    os.makedirs(_OUT.value, exist_ok=True)
    rows = [("base", base_eval(arm_config("full", os.path.join(_OUT.value, "base"))), 0, 0, float("nan"))]
    for arm in ARMS:
        config = arm_config(arm, os.path.join(_OUT.value, arm))
        records = train_lib.train(config)
        tokens = config.data.batch_size * config.data.seq_len
        step_s = float(np.median([tokens / r["tokens_per_sec"] for r in records[1:]] or [np.nan]))
        rows.append((arm, records[-1]["eval_loss"], *state_sizes(config), step_s))
    lines = ["| arm | held-out loss | trainable params | optimizer bytes | step time (s) |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {e:.4f} | {p:,} | {b:,} | {s:.3f} |" for a, e, p, b, s in rows]
    table = "\n".join(lines)
    with open(os.path.join(_OUT.value, "figures.md"), "w") as f:
        f.write(f"{_STEPS.value} steps from {_INIT.value}, data {_DATA.value or 'bundled corpus'}\n\n{table}\n")
    with open(os.path.join(_OUT.value, "figures.json"), "w") as f:
        json.dump([dict(zip(("arm", "eval_loss", "trainable", "opt_bytes", "step_s"), r)) for r in rows], f, indent=2)
    print(table)


if __name__ == "__main__":
    app.run(main)

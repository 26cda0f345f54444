"""Issue 26's table from one command: base vs LoRA (MLA + dense/shared MLPs) vs LoRA + routed experts
vs full SFT, all fine-tuned on the same chat data from one model pretrained here.

    python -m experiments.lora_figures --out=runs/lora_figures [--pretrain_steps=300] [--arm_steps=100] \
        [--pretrained=RUN_OR_HF] [--data=chat.jsonl]

Without --pretrained it first pretrains the tiny config (experiments/configs/tiny.py) for
--pretrain_steps in OUT/pretrained (a finished run there is reused: the trainer resumes it and has
nothing left to do). Each arm then runs experiments.train for --arm_steps steps from that
checkpoint: "full" with experiments/configs/sft.py, the LoRA arms with experiments/configs/lora.py
(lora.experts False / True); same data, seed and batches. Every arm's step-0 record holds the
starting model's two held-out losses (the "base" row, equal across arms) and its last eval the
fine-tuned ones: SFT held-out loss (assistant tokens of the held-out conversations) and the
pretraining corpus's held-out loss (forgetting). Trainable parameters and optimizer bytes are
measured on each arm's final checkpoint (experiments/finetune_report.py), the step time is the
median logged window after the first (which holds the compile). Writes OUT/figures.md and
OUT/figures.json and prints the table.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments import finetune_report, train as train_lib
from experiments.configs import lora as lora_config, sft as sft_config, tiny as tiny_config

_INIT = flags.DEFINE_string("pretrained", None, "pretrained run or HF folder; None: pretrain the tiny config here")
_OUT = flags.DEFINE_string("out", "runs/lora_figures", "folder for the runs, figures.md and figures.json")
_PRE_STEPS = flags.DEFINE_integer("pretrain_steps", 300, "pretraining steps of the tiny config (without --pretrained)")
_STEPS = flags.DEFINE_integer("arm_steps", 100, "fine-tuning steps per arm")
_DATA = flags.DEFINE_string("data", None, "chat .jsonl glob to fine-tune on (None: the bundled chat set)")

ARMS = {  # name: (config module, lora.experts or None for no adapters)
    "LoRA (MLA, dense and shared MLPs)": (lora_config, False),
    "LoRA + routed experts": (lora_config, True),
    "full SFT": (sft_config, None),
}


def pretrain(out: str) -> str:
    workdir = os.path.join(out, "pretrained")
    c = tiny_config.get_config()
    c.train.workdir, c.train.steps = workdir, _PRE_STEPS.value
    train_lib.train(c)
    return workdir


def arm_config(module, experts, workdir: str, init_from: str):
    c = module.get_config()
    if experts is not None:
        c.lora.experts = experts
    c.train.workdir, c.train.init_from, c.train.steps = workdir, init_from, _STEPS.value
    c.train.log_every = max(1, _STEPS.value // 10)
    c.train.eval_every = c.train.checkpoint_every = _STEPS.value
    c.data.path = _DATA.value
    return c


def arm_row(name: str, workdir: str) -> dict:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    run = finetune_report.run_folder.find(workdir)
    sizes = finetune_report.checkpoint_sizes(run.step_dir)
    summary = finetune_report.metrics_summary(workdir, skip_first=True)
    return {"arm": name, "sft_eval": records[-1]["eval_loss"], "pretrain_eval": records[-1]["pretrain_eval_loss"],
            "trainable": sizes["trainable"], "of_total": sizes["of_total"], "opt_bytes": sizes["opt_bytes"],
            "step_s": summary["step_s"], "start": (records[0]["eval_loss"], records[0]["pretrain_eval_loss"])}


def table(rows: list[dict]) -> str:
    lines = ["| arm | SFT held-out loss | pretraining held-out loss | trainable parameters | optimizer bytes | "
             "step time (s) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["arm"] == "base":
            lines.append(f"| base (pretrained) | {r['sft_eval']:.4f} | {r['pretrain_eval']:.4f} | 0 | 0 | - |")
        else:
            lines.append(f"| {r['arm']} | {r['sft_eval']:.4f} | {r['pretrain_eval']:.4f} | "
                         f"{r['trainable']:,} of {r['of_total']:,} | {r['opt_bytes']:,} | {r['step_s']:.3f} |")
    return "\n".join(lines)


def main(argv):
    del argv
    out = _OUT.value
    os.makedirs(out, exist_ok=True)
    init_from = _INIT.value or pretrain(out)
    rows = []
    for name, (module, experts) in ARMS.items():
        workdir = os.path.join(out, name.split(" (")[0].replace(" + ", "_").replace(" ", "_").lower())
        train_lib.train(arm_config(module, experts, workdir, init_from))
        rows.append(arm_row(name, workdir))
    starts = [r.pop("start") for r in rows]
    if max(abs(a - b) for s in starts for a, b in zip(s, starts[0])) > 1e-4:  # one checkpoint, one held-out set
        raise SystemExit(f"the arms' step-0 held-out losses differ: {starts}")
    sft0, pre0 = starts[0]
    rows.insert(0, {"arm": "base", "sft_eval": sft0, "pretrain_eval": pre0})
    text = table(rows)
    with open(os.path.join(out, "figures.md"), "w") as f:
        f.write(f"{_STEPS.value} steps per arm from {init_from}, data {_DATA.value or 'the bundled chat set'}\n\n"
                f"{text}\n")
    with open(os.path.join(out, "figures.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print(text)


if __name__ == "__main__":
    app.run(main)

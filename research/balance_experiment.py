"""Auxiliary-loss-free balancing on vs off: same model, data and seed, gamma vs 0.

    python -m research.balance_experiment [--config=experiments/configs/tiny.py] \
        [--workdir=runs/balance] [--steps=300] [--gamma=0.001]

Trains twice and prints (and writes to WORKDIR/results.json) the mean MaxVio (max expert load / mean load - 1, per batch, averaged
over the main MoE layers) over the last 20% of steps of each run. The sequence-wise balance loss
keeps its configured weight in both runs, so the difference is the bias update alone.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import numpy as np
from absl import flags
from ml_collections import config_flags

from dsv3_jax import cli
from dsv3_jax.train import loop

def define_flags(fv: flags.FlagValues) -> None:
    config_flags.DEFINE_config_file(
        "config", os.path.join(os.path.dirname(__file__), os.pardir, "experiments", "configs", "tiny.py"),
        "Training config file; override fields with --config.a.b=v.", flag_values=fv)
    flags.DEFINE_string("workdir", "runs/balance", "Folder of the two runs and results.json.", flag_values=fv)
    flags.DEFINE_integer("steps", None, "Train steps of each run; default: config.train.steps.", flag_values=fv)
    flags.DEFINE_float("gamma", 1e-3, "Bias update speed of the balanced run.", flag_values=fv)


def tail_maxvio(records: list[dict], key: str = "maxvio", fraction: float = 0.2) -> float:
    """Mean over the last `fraction` of logged steps (and over layers) of a MaxVio list field."""
    tail = records[-max(1, int(round(len(records) * fraction))):]
    return float(np.mean([np.mean(r[key]) for r in tail]))


def run(config, workdir: str, gamma: float) -> dict[float, dict]:
    """Trains with `gamma` and with 0; returns {gamma: {"maxvio", "mtp_maxvio", "lm_loss"}}."""
    results = {}
    for g in (gamma, 0.0):
        c = copy.deepcopy(config)
        with c.unlocked():
            c.balancing.bias_update_speed = g
            c.train.workdir = os.path.join(workdir, f"gamma_{g:g}")
            c.train.log_every = 1  # MaxVio of every step
            c.train.checkpoint_every = c.train.steps  # a single checkpoint at the end
        records = loop.train(c)
        results[g] = {"maxvio": tail_maxvio(records), "lm_loss": float(np.mean([r["lm_loss"] for r in records[-5:]]))}
        if "mtp_maxvio" in records[-1]:
            results[g]["mtp_maxvio"] = tail_maxvio(records, "mtp_maxvio")
    return results


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.log_info()
    config, workdir = args.config, args.workdir
    if args.steps is not None:
        with config.unlocked():
            config.train.steps = args.steps
    loop.quiet_checkpoint_logs()
    results = run(config, workdir, args.gamma)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({f"{g:g}": r for g, r in results.items()}, f, indent=2)
    print(f"mean MaxVio over the last 20% of {config.train.steps} steps (main MoE layers; MTP layer):")
    for g, r in results.items():
        print(f"  gamma={g:g}: {r['maxvio']:.4f}; MTP {r.get('mtp_maxvio', float('nan')):.4f}; "
              f"final lm_loss {r['lm_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

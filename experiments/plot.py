"""Draws a run's curves from WORKDIR/metrics.jsonl.

    python -m experiments.plot --workdir=runs/tiny [--out=DIR]

Writes loss.png (train total / LM / MTP loss, eval loss, and the mean MaxVio per step) and
expert_load.png (share of routed tokens per expert x MoE layer, averaged over the last 20% of
logged steps; a balanced layer is a flat row at 1/E). WORKDIR and DIR may be URLs (gs://bucket/run).
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from dsv3_jax import cli, paths  # noqa: E402


def load_records(workdir: str) -> list[dict]:
    path = paths.join(workdir, "metrics.jsonl")
    if not paths.at(path).exists():
        raise FileNotFoundError(f"{path} does not exist; is {workdir} a training workdir?")
    records = [json.loads(line) for line in paths.at(path).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no records yet")
    return records


def plot_losses(records: list[dict], path: str):
    evals = records
    records = [r for r in records if "loss" in r]  # a fine-tuning run's step 0 holds its evals only
    steps = [r["step"] for r in records]
    fig, (ax, ax_vio) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in ("loss", "lm_loss", "mtp_loss"):
        ax.plot(steps, [r[key] for r in records], label=key)
    for key in ("eval_loss", "pretrain_eval_loss"):  # the second: the pretraining corpus (forgetting)
        points = [(r["step"], r[key]) for r in evals if key in r]
        if points:
            ax.plot(*zip(*points), "o-", label=key)
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="losses")
    ax.legend()
    if "maxvio" in records[0]:
        ax_vio.plot(steps, [np.mean(r["maxvio"]) for r in records], label="main layers")
        if "mtp_maxvio" in records[0]:
            ax_vio.plot(steps, [np.mean(r["mtp_maxvio"]) for r in records], label="MTP layers")
        ax_vio.legend()
    ax_vio.set(xlabel="step", ylabel="max load / mean load - 1", title="MaxVio (batch)")
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: str):
    with paths.at(path).open("wb") as f:  # a local file or an object (URL)
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def moe_layer_numbers(workdir: str, num_rows: int) -> list[int]:
    """The model's layer index of each heatmap row: MoE layers follow the dense ones.

    Read from WORKDIR/model_config.json (written by experiments.train); without it the rows are
    numbered from 0 as MoE layers.
    """
    path = paths.at(paths.join(workdir, "model_config.json"))
    if not path.exists():
        return list(range(num_rows))
    first_moe = json.loads(path.read_text())["num_dense_layers"]
    return list(range(first_moe, first_moe + num_rows))


def expert_load_figure(records: list[dict], layers: list[int] | None = None):
    """Heatmap of the load share per expert (columns) and MoE layer (rows, labelled `layers`)."""
    with_load = [r for r in records if "expert_load" in r]
    if not with_load:
        raise ValueError("metrics.jsonl has no expert_load (a model without MoE layers)")
    tail = with_load[-max(1, len(with_load) // 5):]
    load_LxE = np.mean([r["expert_load"] for r in tail], axis=0)
    layers = list(range(load_LxE.shape[0])) if layers is None else layers
    if len(layers) != load_LxE.shape[0]:
        raise ValueError(f"{len(layers)} layer numbers for {load_LxE.shape[0]} rows of expert_load")
    fig, ax = plt.subplots(figsize=(max(6, load_LxE.shape[1] * 0.35), max(2.5, load_LxE.shape[0] * 0.5 + 1.5)))
    image = ax.imshow(load_LxE, aspect="auto", cmap="viridis")
    fig.colorbar(image, ax=ax, label=f"share of routed tokens (balanced: {1 / load_LxE.shape[1]:.3f})")
    ax.set_yticks(range(len(layers)), [str(n) for n in layers])
    ax.set(xlabel="expert", ylabel="layer (MoE)",
           title=f"expert load, steps {tail[0]['step']}-{tail[-1]['step']}")
    fig.tight_layout()
    return fig


def plot_expert_load(records: list[dict], path: str, layers: list[int] | None = None):
    _save(expert_load_figure(records, layers), path)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("workdir", None, "Run folder holding metrics.jsonl.", required=True, flag_values=fv)
    flags.DEFINE_string("out", None, "Where the PNGs go; default: the workdir.", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.log_info()
    try:
        records = load_records(args.workdir)
    except (FileNotFoundError, ValueError) as e:
        return cli.fail(e)
    out = paths.resolve(args.out or args.workdir)
    paths.makedirs(out)
    plot_losses(records, paths.join(out, "loss.png"))
    rows = len(next((r["expert_load"] for r in records if "expert_load" in r), []))
    layers = moe_layer_numbers(args.workdir, rows)
    plot_expert_load(records, paths.join(out, "expert_load.png"), layers)
    print(f"wrote {paths.join(out, 'loss.png')} and {paths.join(out, 'expert_load.png')}")
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

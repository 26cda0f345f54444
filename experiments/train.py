"""Trains DeepSeek-V3 with the paper's recipe: AdamW + clipping, the DeepSeek (or WSD) schedule,
MTP and sequence-wise balance losses, auxiliary-loss-free bias balancing, Orbax checkpoints.

    python -m experiments.train                                  # tiny model, bundled corpus
    python -m experiments.train --config=experiments/configs/small.py --workdir=runs/small \
        --steps=2000 --config.optimizer.peak_lr=1e-3 --config.data.path='corpus/*.jsonl'
    python -m experiments.train --init_from=CKPT ...             # start from converted weights
    python -m experiments.train --config=experiments/configs/sft.py --init_from=RUN_OR_HF \
        --config.data.path=chat.jsonl                            # chat fine-tuning (docs/finetuning.md)

Multi-host (a TPU pod, a SLURM job, several processes on one machine): every process runs the same
command; they join through `jax.distributed` first, from --coordinator_address / --num_processes /
--process_id, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else the
cluster's own environment (experiments/launch/ starts them; docs/pods.md). config.data.batch_size
is then the rows per process; process 0 writes the metrics.

Chat data (config.data.format="chat") trains on the assistant tokens only; with
config.data.pretrain_eval the eval also reports the pretraining corpus's held-out loss
(`pretrain_eval_loss`, beside `eval_loss`), from step 0 on, so forgetting shows. Bad data or a chat
template that cannot mark assistant turns: one line naming it, exit code 2.

Writes WORKDIR/metrics.jsonl (one object per logged step), WORKDIR/tensorboard/ and Orbax
checkpoints in WORKDIR/checkpoints. Started again with the same command it resumes from the last
checkpoint (parameters, optimizer, router biases, step, RNG and data position), so a killed run
continues exactly. SIGTERM (to one process or several, at any moment) makes every process save a
checkpoint at one agreed step and exit 0.

The run's architecture is fixed once it exists: a resume takes it from WORKDIR/model_config.json,
and --init_from from the checkpoint; asking for another value of a field that says what the model
is (shapes, vocabulary, layers, experts, MTP depth) on resume stops with exit code 2 naming it. The
fields that say how to run it (dtypes, kernels, capacity factor, exchange, remat, pipeline; see
dsv3_jax/train/run_config.py) always come from the command line, and a change is logged.
WORKDIR/config.json and model_config.json record what runs.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax allocates anything: huge pages for the host's buffers
    from dsv3_jax import host

    host.reexec()

import os  # noqa: E402 (after the restart above)

from absl import flags
from ml_collections import config_flags

import sharding
from sharding import multihost
from dsv3_jax import CheckpointError, ConfigError, cli, host, paths
from dsv3_jax.data import DataError
from dsv3_jax.data.chat_template import ChatTemplateError
from dsv3_jax.train import run_config
from dsv3_jax.train.loop import TrainingError, quiet_checkpoint_logs, train

def define_flags(fv: flags.FlagValues) -> None:
    config_flags.DEFINE_config_file(
        "config", os.path.join(os.path.dirname(__file__), "configs", "tiny.py"),
        "Training config file (experiments/configs/<name>.py); override fields with --config.a.b=v.", flag_values=fv)
    flags.DEFINE_string("workdir", None, "Run folder; default: config.train.workdir.", flag_values=fv)
    flags.DEFINE_integer("steps", None, "Total train steps; default: config.train.steps.", flag_values=fv)
    flags.DEFINE_string("init_from", None, "Converted Orbax checkpoint or HF folder to start from (ignored when "
                        "WORKDIR already holds a checkpoint).", flag_values=fv)
    flags.DEFINE_string("coordinator_address", None, "Multi-host: HOST:PORT of process 0 (default: "
                        "JAX_COORDINATOR_ADDRESS or the cluster's environment).", flag_values=fv)
    flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.", flag_values=fv)
    flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.log_info()
    if multihost.initialize(args.coordinator_address, args.num_processes, args.process_id):
        host.order_cpu_collectives()  # before the backend starts: gloo pairs collectives by order
    config = args.config
    with config.unlocked():
        if args.workdir is not None:
            config.train.workdir = args.workdir
        if args.steps is not None:
            config.train.steps = args.steps
        if args.init_from is not None:
            config.train.init_from = args.init_from
    quiet_checkpoint_logs()
    try:
        train(config)
    except (CheckpointError, ConfigError, DataError, ChatTemplateError, run_config.ModelChanged, TrainingError,
            sharding.MeshError, sharding.ShardingRuleError, OSError) as e:
        return cli.fail(e)
    print(next_steps(paths.display(paths.resolve(config.train.workdir))), flush=True)
    return 0


def next_steps(workdir: str) -> str:
    """Where a finished run's outputs are and the commands that use them."""
    hf_out = f"{workdir}/hf" if not paths.is_url(workdir) else "hf"  # the converter writes a local folder
    return "\n".join([
        f"outputs in {workdir}/: metrics.jsonl, tensorboard/, checkpoints/<step>/ (the latest is used below)",
        "next:",
        f"  python -m experiments.plot --workdir={workdir}                       # loss curves, expert loads",
        f"  python -m experiments.generate --checkpoint={workdir} --prompt=\"Once upon a time\"  # sample text",
        f"  python -m dsv3_jax.convert --to-hf --ckpt={workdir} --out={hf_out}            # HF folder + tokenizer",
    ])


if __name__ == "__main__":
    cli.exit_with(main())

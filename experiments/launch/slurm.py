"""A SLURM batch script for GPU clusters: one task per node, each running the same
`python -m experiments.train ...` with all of its node's GPUs. `jax.distributed` picks the cluster
up from SLURM's environment (SLURM_PROCID = process id, SLURM_NTASKS = processes, the first node
of SLURM_STEP_NODELIST = coordinator), see `sharding.multihost.initialize`.

    python -m experiments.launch.slurm --nodes 2 [--gpus_per_node 8] [--partition P] [--time 48:00:00] \
        [--repo_dir .] [--out job.sbatch] [--dry_run [--nodelist 'gpu[001-002]' --job_id 1234]] -- FLAGS
    sbatch job.sbatch

--dry_run prints the script and, per node, the process id, the coordinator jax will derive and
the command; nothing is written or submitted.
"""

from __future__ import annotations

import re
import shlex
import sys

from absl import flags

from dsv3_jax import cli
from experiments.launch import hosts as hosts_lib


def batch_script(nodes: int, gpus_per_node: int, flags: list[str], *, partition: str | None = None,
                 time: str | None = None, repo_dir: str = ".", job_name: str = "dsv3-train") -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={gpus_per_node}", "#SBATCH --exclusive",
             "#SBATCH --output=%x-%j.%t.out"]
    lines += [f"#SBATCH --partition={partition}"] if partition else []
    lines += [f"#SBATCH --time={time}"] if time else []
    lines += ["set -euo pipefail", f"cd {shlex.quote(repo_dir)}",
              "# One process per node; jax.distributed reads SLURM_PROCID / SLURM_NTASKS / SLURM_STEP_NODELIST.",
              "srun --kill-on-bad-exit=1 " + " ".join(map(shlex.quote, hosts_lib.train_argv(flags)))]
    return "\n".join(lines) + "\n"


def expand_nodelist(nodelist: str) -> list[str]:
    """'gpu[001-003,007],login1' -> ['gpu001', 'gpu002', 'gpu003', 'gpu007', 'login1']."""
    out = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            out.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            out += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def coordinator(nodelist: str, job_id: int) -> str:
    """The address jax.distributed derives under SLURM: first node, port from the job id."""
    return f"{expand_nodelist(nodelist)[0]}:{job_id % 2**12 + (65535 - 2**12 + 1)}"


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("nodes", None, "nodes of the job, one process each", required=True, flag_values=fv)
    flags.DEFINE_integer("gpus_per_node", 8, "GPUs each process drives", flag_values=fv)
    flags.DEFINE_string("partition", None, "#SBATCH --partition", flag_values=fv)
    flags.DEFINE_string("time", None, "#SBATCH --time (e.g. 48:00:00)", flag_values=fv)
    flags.DEFINE_string("repo_dir", ".", "this repository on the nodes", flag_values=fv)
    flags.DEFINE_string("out", "job.sbatch", "the batch script to write", flag_values=fv)
    flags.DEFINE_boolean("dry_run", False, "print the script and each node's command; write nothing", flag_values=fv)
    flags.DEFINE_string("nodelist", None, "with --dry_run: the nodes SLURM would give (default node[1-N])",
                        flag_values=fv)
    flags.DEFINE_integer("job_id", 1, "with --dry_run: the job id (sets the port)", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__, rest=True)  # rest: the flags of experiments.train after --
    if args.nodes < 1:
        cli.usage(f"--nodes={args.nodes} must be at least 1")
    script = batch_script(args.nodes, args.gpus_per_node, args.rest, partition=args.partition, time=args.time,
                          repo_dir=args.repo_dir)
    if not args.dry_run:
        with open(args.out, "w") as f:
            f.write(script)
        print(f"wrote {args.out}; submit with: sbatch {args.out}")
        return 0
    nodelist = args.nodelist or f"node[1-{args.nodes}]"
    nodes = expand_nodelist(nodelist)
    if len(nodes) != args.nodes:
        cli.usage(f"--nodelist {nodelist!r} has {len(nodes)} nodes, --nodes={args.nodes}")
    print(script, end="")
    cmds = hosts_lib.commands(nodes, args.rest)
    for i, c in enumerate(cmds):
        env = hosts_lib.join_env(coordinator(nodelist, args.job_id), len(nodes), i)
        print(f"[process {i} on {c.host}] " + hosts_lib.HostCommand(c.host, env, c.argv).shell())
    return 0


if __name__ == "__main__":
    sys.exit(main())

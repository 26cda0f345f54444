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

import argparse
import re
import shlex
import sys

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus_per_node", type=int, default=8)
    p.add_argument("--partition", default=None)
    p.add_argument("--time", default=None)
    p.add_argument("--repo_dir", default=".")
    p.add_argument("--out", default="job.sbatch")
    p.add_argument("--dry_run", action="store_true")
    p.add_argument("--nodelist", default=None, help="with --dry_run: the nodes SLURM would give (default node[1-N])")
    p.add_argument("--job_id", type=int, default=1, help="with --dry_run: the job id (sets the port)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the flags of experiments.train")
    args = p.parse_args(argv)
    if args.nodes < 1:
        p.error(f"--nodes={args.nodes} must be at least 1")
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    script = batch_script(args.nodes, args.gpus_per_node, flags, partition=args.partition, time=args.time,
                          repo_dir=args.repo_dir)
    if not args.dry_run:
        with open(args.out, "w") as f:
            f.write(script)
        print(f"wrote {args.out}; submit with: sbatch {args.out}")
        return 0
    nodelist = args.nodelist or f"node[1-{args.nodes}]"
    nodes = expand_nodelist(nodelist)
    if len(nodes) != args.nodes:
        p.error(f"--nodelist {nodelist!r} has {len(nodes)} nodes, --nodes={args.nodes}")
    print(script, end="")
    cmds = hosts_lib.commands(nodes, flags)
    for i, c in enumerate(cmds):
        env = hosts_lib.join_env(coordinator(nodelist, args.job_id), len(nodes), i)
        print(f"[process {i} on {c.host}] " + hosts_lib.HostCommand(c.host, env, c.argv).shell())
    return 0


if __name__ == "__main__":
    sys.exit(main())

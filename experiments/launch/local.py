"""N training processes on this machine, joined through `jax.distributed` on 127.0.0.1: the
multi-host code path without a cluster (e.g. 2 processes x 4 fake CPU devices).

    python -m experiments.launch.local --processes 2 [--port 8476] [--dry_run] -- --workdir=runs/x ...

Output of process 0 is shown; the others go to `launch_local.<i>.log` in --log_dir (default: the
current folder). Exit code: the first non-zero one of the processes.
"""

from __future__ import annotations

import os
import subprocess
import sys

from absl import flags

from dsv3_jax import cli
from experiments.launch import hosts as hosts_lib


def commands(processes: int, flags: list[str], port: int = hosts_lib.COORDINATOR_PORT) -> list[hosts_lib.HostCommand]:
    return hosts_lib.commands(["127.0.0.1"] * processes, flags, port=port, python=sys.executable)


def start(cmds: list[hosts_lib.HostCommand], env: dict | None = None, **popen) -> list[subprocess.Popen]:
    """Starts every command here with its JAX_* variables added to `env` (default: os.environ)."""
    base = dict(os.environ if env is None else env)
    return [subprocess.Popen(c.argv, env={**base, **c.env}, **popen) for c in cmds]


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("processes", None, "training processes to start", required=True, flag_values=fv)
    flags.DEFINE_integer("port", hosts_lib.COORDINATOR_PORT, "the coordinator's port", flag_values=fv)
    flags.DEFINE_boolean("dry_run", False, "print each process's command and exit", flag_values=fv)
    flags.DEFINE_string("log_dir", ".", "folder of the logs of processes 1..N-1 (launch_local.<i>.log)",
                        flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__, rest=True)  # rest: the flags of experiments.train after --
    if args.processes < 1:
        cli.usage(f"--processes={args.processes} must be at least 1")
    cmds = commands(args.processes, args.rest, args.port)
    if args.dry_run:
        for i, c in enumerate(cmds):
            print(f"[process {i}] {c.shell()}")
        return 0
    os.makedirs(args.log_dir, exist_ok=True)
    logs = [None] + [open(os.path.join(args.log_dir, f"launch_local.{i}.log"), "w") for i in range(1, len(cmds))]
    procs = [subprocess.Popen(c.argv, env={**os.environ, **c.env}, stdout=log, stderr=log)
             for c, log in zip(cmds, logs)]
    codes = [proc.wait() for proc in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())

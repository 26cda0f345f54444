"""Runs the same `python -m experiments.train ...` on every worker of a TPU VM pod, one or several
slices (multi-slice over DCN), through `gcloud compute tpus tpu-vm ssh --worker=i`.

    python -m experiments.launch.tpu_pod --tpu NAME --zone ZONE [--project P] [--slices S] \
        [--repo_dir ~/dsv3-jax] [--dry_run [--workers_per_slice N]] -- --config=... --workdir=gs://...

Process i = slice * workers_per_slice + worker joins through JAX_COORDINATOR_ADDRESS (worker 0 of
slice 0, port 8476), JAX_NUM_PROCESSES and JAX_PROCESS_ID. With --slices S the slices are the TPU
VMs NAME-0 ... NAME-{S-1} (a queued-resource multi-slice names them so); each worker also gets
MEGASCALE_COORDINATOR_ADDRESS / MEGASCALE_NUM_SLICES / MEGASCALE_SLICE_ID for the DCN transport,
and the training command `--config.mesh.dcn_data=S` so the `data` axis is the one that crosses
slices. Worker addresses come from `gcloud compute tpus tpu-vm describe`; --dry_run with
--workers_per_slice prints the commands with placeholder hosts (NAME-w-i) and runs nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys

from absl import flags

from dsv3_jax import cli
from experiments.launch import hosts as hosts_lib

MEGASCALE_PORT = 8080


def slice_names(tpu: str, slices: int) -> list[str]:
    return [tpu] if slices == 1 else [f"{tpu}-{s}" for s in range(slices)]


def worker_ips(name: str, zone: str, project: str | None) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", "describe", name, f"--zone={zone}", "--format=json"]
    cmd += [f"--project={project}"] if project else []
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed: {out.stderr.strip()}")
    return [e["ipAddress"] for e in json.loads(out.stdout)["networkEndpoints"]]


def pod_commands(slices: list[list[str]], flags: list[str]) -> list[hosts_lib.HostCommand]:
    """One command per worker; `slices` lists each slice's worker addresses."""
    per_slice = {len(s) for s in slices}
    if len(per_slice) != 1:
        raise ValueError(f"slices have different worker counts {sorted(per_slice)}")
    workers = [h for s in slices for h in s]
    n = len(slices)
    if n > 1:
        flags = [*flags, f"--config.mesh.dcn_data={n}"]

    def megascale(process_id: int) -> dict[str, str]:
        if n == 1:
            return {}
        return {"MEGASCALE_COORDINATOR_ADDRESS": f"{workers[0]}:{MEGASCALE_PORT}", "MEGASCALE_NUM_SLICES": str(n),
                "MEGASCALE_SLICE_ID": str(process_id // len(slices[0])), "MEGASCALE_PORT": str(MEGASCALE_PORT)}

    return hosts_lib.commands(workers, flags, extra_env=megascale)


def ssh_command(name: str, worker: int, zone: str, project: str | None, line: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", name, f"--zone={zone}", f"--worker={worker}"]
    return cmd + ([f"--project={project}"] if project else []) + [f"--command={line}"]


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("tpu", None, "TPU VM name (multi-slice: the prefix of NAME-0, NAME-1, ...)",
                        required=True, flag_values=fv)
    flags.DEFINE_string("zone", None, "the TPU VM's zone", required=True, flag_values=fv)
    flags.DEFINE_string("project", None, "Google Cloud project (default: gcloud's)", flag_values=fv)
    flags.DEFINE_integer("slices", 1, "TPU slices (multi-slice: NAME-0, NAME-1, ...)", flag_values=fv)
    flags.DEFINE_string("repo_dir", "~/dsv3-jax", "this repository on every worker", flag_values=fv)
    flags.DEFINE_boolean("dry_run", False, "print each worker's command; run nothing", flag_values=fv)
    flags.DEFINE_integer("workers_per_slice", None, "with --dry_run: skip gcloud describe and use placeholder hosts",
                         flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__, rest=True)  # rest: the flags of experiments.train after --
    if args.slices < 1:
        cli.usage(f"--slices={args.slices} must be at least 1")
    if args.workers_per_slice is not None and not args.dry_run:
        cli.usage("--workers_per_slice is for --dry_run; a real launch asks gcloud for the workers")
    names = slice_names(args.tpu, args.slices)
    if args.workers_per_slice is not None:
        slices = [[f"{name}-w-{w}" for w in range(args.workers_per_slice)] for name in names]
    else:
        slices = [worker_ips(name, args.zone, args.project) for name in names]
    cmds = pod_commands(slices, args.rest)
    per_slice = len(slices[0])
    ssh = [ssh_command(names[i // per_slice], i % per_slice, args.zone, args.project, c.shell(args.repo_dir))
           for i, c in enumerate(cmds)]
    if args.dry_run:
        for i, (c, s) in enumerate(zip(cmds, ssh)):
            print(f"[process {i} on {c.host}] {' '.join(s[:-1])} --command={c.shell(args.repo_dir)!r}")
        return 0
    procs = [subprocess.Popen(s) for s in ssh]
    codes = [proc.wait() for proc in procs]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())

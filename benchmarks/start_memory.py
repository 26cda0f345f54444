"""Peak memory of a multi-process start and resume: N processes x K fake CPU
devices run `python -m experiments.train` on a model whose train state (fp32 parameters + two AdamW
moments) is ~1.85 GB, on a mesh that splits it over all devices; each process's peak RSS
(`/usr/bin/time -v`) is compared with the same run of the tiny default, on a fresh start and on a
resume after SIGKILL, and the loss curve with one process holding all devices.

    python -m benchmarks.start_memory --mesh=fsdp=8 [--mesh=fsdp=2,expert=4] [--code=/path/to/checkout]

`--code`: the checkout whose experiments.train runs (default: this one), e.g. a worktree of an
older commit for a before/after figure. Prints one JSON line per run and a summary per mesh.
Memory heavy (N processes at once): run it on an idle machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl import flags

from dsv3_jax import cli
from experiments.launch import local

# The tiny config grown to a ~1.85 GB train state in the 671B's proportions: 13 MoE layers + the
# MTP layer of 16 experts of 512 x 400, so one layer is ~1/14 of the state (1/61 at 671B). Under
# plain fsdp each device gathers one layer's weights and gradients at a time; with 3 layers of
# 512 x 1600 (a layer ~1/4 of a 2.08 GB state) that alone was ~0.9 x the state per process.
# Each process holds a quarter of the state on 4 processes.
SIZES = {"hidden_size": 512, "intermediate_size": 2048, "moe_intermediate_size": 400, "num_routed_experts": 16,
         "num_layers": 14}
# Per-layer remat, as the 671B config: the backward gathers a layer's weights again instead of
# keeping every layer's gathered weights from the forward.
BIG = [f"--config.model.{k}={v}" for k, v in SIZES.items()] + ["--config.model.remat=True"]
# Short runs: a global batch of 8 rows (config.data.batch_size is per process), a checkpoint every
# 2 steps, a metrics line every step, no eval.
RUN = ["--config.data.seq_len=32", "--config.train.log_every=1",
       "--config.train.eval_every=0", "--config.train.checkpoint_every=2", "--config.train.compilation_cache=",
       "--config.optimizer.warmup_steps=2"]
STEPS = 6


def state_bytes() -> int:
    """fp32 parameters + 2 fp32 moments of the BIG model (ModelConfig's own count; its `total`
    leaves out the MTP layer, which the train state holds as well: 1.851 GB, not 1.718)."""
    from dsv3_jax import ModelConfig
    from experiments.configs.tiny import get_config

    d = get_config().model.to_dict()
    d.update(SIZES)
    counts = ModelConfig.from_dict(d).param_counts()
    return 12 * (counts["total"] + counts["mtp"])


def env(code: str, devices: int) -> dict:
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=code,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                       "--xla_cpu_collective_timeout_seconds=900 --xla_cpu_collective_call_terminate_timeout_seconds=900")
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        e.pop(k, None)
    return e


def peak_rss(log: str) -> int:
    """Bytes: /usr/bin/time -v's maximum resident set size."""
    return 1024 * int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(log).read()).group(1))


def start(code, workdir, processes, devices, flags, logs_prefix, port):
    cmds = local.commands(processes, [f"--workdir={workdir}", *flags], port=port)
    procs = []
    for i, c in enumerate(cmds):
        log = open(f"{logs_prefix}.{i}.log", "w")
        procs.append(subprocess.Popen(["/usr/bin/time", "-v", *c.argv], env={**env(code, devices), **c.env},
                                      cwd=code, stdout=subprocess.DEVNULL, stderr=log))
    return procs, [f"{logs_prefix}.{i}.log" for i in range(processes)]


def curve(workdir) -> list[float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def run(code, workdir, processes, devices, flags, tag, port, kill_at_checkpoint=None) -> list[int]:
    """Peak RSS of each process; with `kill_at_checkpoint`, SIGKILL to all once that step is saved."""
    procs, logs = start(code, workdir, processes, devices, flags, os.path.join(workdir + "_logs", tag), port)
    if kill_at_checkpoint is not None:
        done = os.path.join(workdir, "checkpoints", str(kill_at_checkpoint))
        while not os.path.isdir(done):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{tag}: a process ended before step {kill_at_checkpoint}: {logs}")
            time.sleep(0.5)
        for p in procs:  # the trainer is time -v's child: kill it, and time reports its peak
            with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                for child in f.read().split():
                    os.kill(int(child), signal.SIGKILL)
    codes = [p.wait() for p in procs]
    if kill_at_checkpoint is None and any(codes):
        raise RuntimeError(f"{tag} failed ({codes}): see {logs}")
    peaks = [peak_rss(log) for log in logs]
    print(json.dumps({"run": tag, "peak_rss_bytes": peaks}), flush=True)
    return peaks


def measure(code: str, mesh: str, processes: int, devices: int, root: str, port: int, fresh_only: bool) -> dict:
    mesh_flags = [f"--config.mesh.{kv.split('=')[0]}={kv.split('=')[1]}" for kv in mesh.split(",")]
    mesh_flags.append("--config.mesh.data=1")
    batch = [f"--config.data.batch_size={8 // processes}"]
    common = [*RUN, *batch, f"--steps={STEPS}", *mesh_flags]
    name = mesh.replace(",", "_").replace("=", "")
    for d in ("tiny", "big", "one"):
        os.makedirs(os.path.join(root, f"{name}_{d}_logs"), exist_ok=True)
    tiny = run(code, os.path.join(root, f"{name}_tiny"), processes, devices, [*RUN, *batch, "--steps=2", *mesh_flags],
               "tiny", port)
    big_dir = os.path.join(root, f"{name}_big")
    fresh = run(code, big_dir, processes, devices, [*BIG, *common], "fresh", port, kill_at_checkpoint=2)
    state = state_bytes()
    if fresh_only:
        out = {"mesh": mesh, "state_bytes": state, "tiny_peak": tiny,
               "fresh_peak_above_tiny_over_state": [round((f - t) / state, 3) for f, t in zip(fresh, tiny)]}
        print(json.dumps(out), flush=True)
        return out
    resumed = run(code, big_dir, processes, devices, [*BIG, *common], "resume", port)
    one_dir = os.path.join(root, f"{name}_one")
    run(code, one_dir, 1, processes * devices, [*BIG, *common, "--config.data.batch_size=8"],
        "one", port)
    got, want = curve(big_dir), curve(one_dir)
    out = {"mesh": mesh, "state_bytes": state, "tiny_peak": tiny,
           "fresh_peak_above_tiny_over_state": [round((f - t) / state, 3) for f, t in zip(fresh, tiny)],
           "resume_peak_above_tiny_over_state": [round((r - t) / state, 3) for r, t in zip(resumed, tiny)],
           "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(got, want)), "steps": len(got)}
    print(json.dumps(out), flush=True)
    return out


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_multi_string("mesh", None, "axis=size[,axis=size]; repeatable", flag_values=fv)
    flags.DEFINE_integer("processes", 4, "training processes", flag_values=fv)
    flags.DEFINE_integer("devices", 2, "fake CPU devices per process", flag_values=fv)
    flags.DEFINE_string("code", os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "the checkout whose experiments.train runs", flag_values=fv)
    flags.DEFINE_integer("port", 8476, "the coordinator's port", flag_values=fv)
    flags.DEFINE_boolean("fresh_only", False, "only the tiny run and the fresh start (a quick before)", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    root = tempfile.mkdtemp(prefix="start_memory_")
    for mesh in args.mesh or ["fsdp=8"]:
        measure(os.path.abspath(args.code), mesh, args.processes, args.devices, root, args.port, args.fresh_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())

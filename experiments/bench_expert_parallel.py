"""Expert parallelism end to end: `experiments.train` on 8 fake CPU devices with `mesh.expert=8`
against one device, same config and steps, for this checkout and (optionally) an older one.

    git archive main | tar -x -C /tmp/before       # the code before, outside this checkout
    python -m experiments.bench_expert_parallel --before /tmp/before [--steps 25]

Runs alternate (before 1 device, before 8 devices, after 1, after 8, then the same again per
`--rounds`), each in its own process; tokens/s is the median over the logged windows after the
first (which holds compilation). The 8 fake devices share this host's cores, so the 8-device run
cannot beat one device; the ratio says how much the expert-parallel program costs beyond the
same model's work. A receive side that runs its whole [P*C, D] buffer does P x the routed expert
work; one that computes the rows it received does the routed work.

Also printed, from the config (no run needed): the receive buffer per device, P*C rows of D in
the compute dtype, dropless (C = M, every row of every peer) and with a capacity factor, and the
rows a device's grouped matmul runs through its experts per MoE layer, before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P = 8
MiB = 1024 ** 2


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="a checkout of the code before (e.g. `git archive main`)")
    p.add_argument("--config", default="experiments/configs/tiny.py")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--log_every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="alternations of the four runs")
    p.add_argument("--capacity_factor", type=float, default=1.0, help="also run this one with a capacity factor")
    return p.parse_args()


def train_tokens_per_sec(code: str, devices: int, args, *extra: str) -> tuple[float, dict]:
    """Median tokens/s of `python -m experiments.train` run from `code` on `devices` fake devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=code, PYTHONDONTWRITEBYTECODE="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    mesh = ["--config.mesh.data=1", f"--config.mesh.expert={P}"] if devices > 1 else []
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, "-m", "experiments.train", f"--config={os.path.join(code, args.config)}",
               f"--workdir={workdir}", f"--steps={args.steps}", f"--config.train.log_every={args.log_every}",
               "--config.train.eval_every=0", f"--config.train.checkpoint_every={10 * args.steps}", *mesh, *extra]
        out = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{' '.join(cmd)} failed in {code}:\n{out.stderr[-3000:]}")
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    return statistics.median(r["tokens_per_sec"] for r in records[1:]), records[-1]


def buffer_report(args) -> None:
    sys.path.insert(0, REPO)
    import importlib.util

    import numpy as np

    from sharding import expert_parallel
    spec = importlib.util.spec_from_file_location("bench_config", os.path.join(REPO, args.config))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    tokens = c.data.batch_size * c.data.seq_len // P
    m = tokens * c.model.num_experts_per_token
    row_bytes = c.model.hidden_size * np.dtype(c.model.compute_dtype).itemsize
    print(f"per device: {tokens} tokens x top-{c.model.num_experts_per_token} = M = {m} (token, expert) rows; "
          f"expert={P}; D = {c.model.hidden_size} in {c.model.compute_dtype}")
    for name, cf in (("dropless", None), (f"capacity factor {args.capacity_factor}", args.capacity_factor)):
        r = P * expert_parallel.capacity(m, P, cf)
        print(f"  receive buffer, {name:<22} {r:>7} rows  {r * row_bytes / MiB:8.3f} MiB per MoE layer "
              f"(x2 with the results' return buffer)")
    print(f"  rows through the experts per MoE layer: before {P * m} (the whole dropless buffer), "
          f"after ~{m} on average (the rows received, rounded up to the tile per expert)")


def main() -> None:
    args = _parse()
    buffer_report(args)
    codes = ([("before", os.path.abspath(args.before))] if args.before else []) + [("after", REPO)]
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, code in codes:
            for devices in (1, P):
                tps, _ = train_tokens_per_sec(code, devices, args)
                results.setdefault((name, devices), []).append(tps)
                print(f"  {name:<6} {devices} device(s): {tps:9.1f} tokens/s", flush=True)
    print(f"\n{'code':<8}{'1 device':>12}{'8 devices':>12}{'8 / 1':>9}   (train tokens/s, medians)")
    for name, _ in codes:
        one, eight = statistics.median(results[(name, 1)]), statistics.median(results[(name, P)])
        print(f"{name:<8}{one:>12.1f}{eight:>12.1f}{eight / one:>9.3f}")
    if args.capacity_factor:
        tps, last = train_tokens_per_sec(REPO, P, args, f"--config.model.expert_capacity_factor={args.capacity_factor}")
        print(f"after, 8 devices, capacity factor {args.capacity_factor}: {tps:.1f} tokens/s, "
              f"dropped_fraction at the last step {last['dropped_fraction']:.4f}")


if __name__ == "__main__":
    main()

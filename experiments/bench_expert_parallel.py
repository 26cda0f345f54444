"""Expert parallelism end to end: `experiments.train` on 8 fake CPU devices with `mesh.expert=8`
against one device, same config and steps, for this checkout and (optionally) an older one.

    git archive 2eac503^ | tar -x -C /tmp/before   # the code before the receive side computed only
    python -m experiments.bench_expert_parallel --before /tmp/before [--steps 25] [--rounds 2]

Runs alternate (before 1 device, before 8 devices, after 1, after 8, then the same again per
`--rounds`), each in its own process; tokens/s is the median over the logged windows after the
first (which holds compilation). The 8 fake devices share this host's cores, so the 8-device run
cannot beat one device; the ratio says how much the expert-parallel program costs beyond the
same model's work. A receive side that runs its whole [P*C, D] buffer does P x the routed expert
work; one that computes the rows it received does the routed work.

Also printed, from the config (no run needed): the receive buffer per device, P*C rows of D in
the compute dtype, dropless (C = M, every row of every peer) and with a capacity factor, and the
rows a device's grouped matmul runs through its experts per MoE layer, before and after
(before: every buffer row; after: the rows received, ~M under balanced routing, each expert's group
rounded up to the tile). The table is printed last.
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


def buffer_rows(args) -> dict:
    """Per device and MoE layer, from the config: M, the receive buffer and the rows computed."""
    sys.path.insert(0, REPO)
    import importlib.util

    import numpy as np

    from dsv3_jax.ops import dispatch
    from sharding import expert_parallel
    spec = importlib.util.spec_from_file_location("bench_config", os.path.join(REPO, args.config))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    m = c.data.batch_size * c.data.seq_len // P * c.model.num_experts_per_token
    local_experts = c.model.num_routed_experts // P
    r = {"m": m, "row_bytes": c.model.hidden_size * np.dtype(c.model.compute_dtype).itemsize,
         "what": f"{c.data.batch_size * c.data.seq_len // P} tokens x top-{c.model.num_experts_per_token} = "
                 f"M = {m} rows per device; E/P = {local_experts} local experts; D = {c.model.hidden_size} "
                 f"in {c.model.compute_dtype}"}
    for name, cf in (("dropless", None), ("cf", args.capacity_factor)):
        buffer = P * expert_parallel.capacity(m, P, cf)
        # after: the rows received (M on average under balanced routing; the whole buffer when
        # every peer routes all its rows here), each local expert's group rounded up to the tile
        tile = dispatch.tile_rows(buffer, local_experts, c.model.moe_tile_size)
        r[name] = {"buffer": buffer, "before": f"{buffer}",
                   "after": f"~{min(buffer, m)} + <= {local_experts * tile} tile rounding"}
    return r


def print_table(args, rows: dict, tps: dict, cf_run: tuple[float, dict] | None) -> None:
    """The issue's table: tokens/s ratio before and after, buffer bytes and rows per device."""
    def cell(name, devices):
        return f"{statistics.median(tps[(name, devices)]):.1f}" if (name, devices) in tps else "-"

    def ratio(name):
        if (name, 1) not in tps:
            return "-"
        return f"{statistics.median(tps[(name, P)]) / statistics.median(tps[(name, 1)]):.3f}"

    cf = args.capacity_factor
    lines = [("train tokens/s, 1 device", cell("before", 1), cell("after", 1)),
             (f"train tokens/s, {P} devices (expert={P})", cell("before", P), cell("after", P)),
             (f"ratio {P} devices / 1 device", ratio("before"), ratio("after"))]
    if cf_run:
        lines.append((f"train tokens/s, {P} devices, cf {cf:g}", "-", f"{cf_run[0]:.1f} "
                      f"(dropped {cf_run[1]['dropped_fraction']:.4f})"))
    for name, label in (("dropless", "dropless"), ("cf", f"cf {cf:g}")):
        b = rows[name]["buffer"]
        mib = f"{b} rows, {b * rows['row_bytes'] / MiB:.3f} MiB"
        lines.append((f"receive buffer per device, {label}", mib, mib))
        lines.append((f"rows computed per MoE layer per device, {label}", rows[name]["before"],
                      rows[name]["after"]))
    print(f"\n{rows['what']}; buffer bytes are per MoE layer, x2 with the results' return buffer")
    width = max(len(k) for k, _, _ in lines)
    print(f"{'':<{width}}  {'before':>24}  {'after':>32}")
    for k, before, after in lines:
        print(f"{k:<{width}}  {before:>24}  {after:>32}")


def main() -> None:
    args = _parse()
    rows = buffer_rows(args)
    codes = ([("before", os.path.abspath(args.before))] if args.before else []) + [("after", REPO)]
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, code in codes:
            for devices in (1, P):
                tps, _ = train_tokens_per_sec(code, devices, args)
                results.setdefault((name, devices), []).append(tps)
                print(f"  {name:<6} {devices} device(s): {tps:9.1f} tokens/s", flush=True)
    cf_run = None
    if args.capacity_factor:
        cf_run = train_tokens_per_sec(REPO, P, args, f"--config.model.expert_capacity_factor={args.capacity_factor}")
    print_table(args, rows, results, cf_run)


if __name__ == "__main__":
    main()

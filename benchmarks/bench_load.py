"""Sharded loading benchmark: peak RSS of `load_pretrained` on a synthetic HF folder, unsharded (one
process, one device) against two processes x 4 fake CPU devices (`jax.distributed` on 127.0.0.1)
on an fsdp=2 x expert=4 mesh, one process onto those 8 devices, and one process onto 8 devices on
an fsdp=8 mesh. Each load runs in its own
subprocess; each also checks every parameter's sharding against the rules table and compares the
logits with the unsharded load.

    python -m benchmarks.bench_load [--workdir /tmp/dsv3_load] [--size-gb 1] [--fp8] [--keep]

Pass criteria: each process of the two-process load peaks below 0.6 x the unsharded
load (peak RSS against peak RSS); the 8-device load below 1.3 x the model's bytes, where:
- "the model's bytes" are the parameters' bytes (each parameter once, in its loaded dtype: bf16
  for an FP8 folder, so twice the folder's expert bytes);
- the load's peak is the peak RSS less the RSS before loading (the interpreter, jax and the XLA
  client with its 8 devices, ~0.23 GB here, the same whatever is loaded, and nothing at 671B).
What the load itself may not exceed is what the devices must hold plus one block of staging. On
fake CPU devices the shards live in host RAM, and on the fsdp=2 x expert=4 mesh every non-expert
parameter is split over fsdp only, so it is held 4 times (once per expert rank): the devices hold
`device_bytes` = 1.16 x the model's bytes for the bf16 1 GB folder (1.13 x for the FP8 one),
inherent to the mesh. The rest, peak - before - device_bytes, is the staging: one device block
being read, plus the MTP copy comparison's 8 MB row blocks; it is printed too (0.02 x here).
The fourth load, one process onto 8 devices on an fsdp=8 mesh (nothing replicated), is held to
the plain criterion: raw peak RSS, runtime included, below 1.3 x the model's bytes (1.267 x for
the bf16 1 GB folder).

    python -m benchmarks.bench_load worker HF_DIR OUT MODE [PORT PROCESS_ID]

runs one load (MODE: unsharded, one8, one8_fsdp or two) and writes OUT.<process>.json (+ .npy logits).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from absl import flags

from dsv3_jax import cli

MESH = {"fsdp": 2, "expert": 4}
FSDP8 = {"fsdp": 8}  # "one8_fsdp": one process, 8 devices, nothing replicated (every leaf split over fsdp)
TOKENS = [[3, 17, 5, 90, 1, 64, 33, 8], [7, 7, 2, 41, 12, 0, 25, 60]]


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def worker(hf_dir: str, out: str, mode: str, port: int = 0, process_id: int = 0, dtype: str | None = None) -> None:
    devices = {"unsharded": 1, "one8": 8, "one8_fsdp": 8, "two": 4}[mode]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
                               " --xla_cpu_collective_timeout_seconds=900")
    from sharding import multihost

    if mode == "two":
        multihost.initialize(f"127.0.0.1:{port}", 2, process_id)
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    import sharding
    from dsv3_jax.checkpoint import hf_reader, load_pretrained
    from dsv3_jax.model.params import logical_axes

    counted = {"bytes": 0}
    window = hf_reader.HFReader.window

    def counting_window(self, *args, **kwargs):  # every byte the loader reads goes through here
        before = self.bytes_read
        x = window(self, *args, **kwargs)
        counted["bytes"] += self.bytes_read - before
        return x

    hf_reader.HFReader.window = counting_window
    mesh = None if mode == "unsharded" else sharding.make_mesh(FSDP8 if mode == "one8_fsdp" else MESH)
    jax.devices()  # the XLA client and its devices exist before the "before" figure
    rss_before = _rss("VmRSS")
    # float32 arithmetic: sharded and unsharded logits then differ by summation order only
    model = load_pretrained(hf_dir, dtype, mesh=mesh, compute_dtype="float32")
    peak = _rss("VmHWM")
    rules = sharding.get_rules("default")
    checked, param_bytes, device_bytes = 0, 0, 0
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        value = var[...]
        param_bytes += value.nbytes
        device_bytes += sum(shard.data.nbytes for shard in value.addressable_shards)  # replicas included
        if mesh is not None:
            want = sharding.named_sharding(logical_axes(var), value.shape, mesh, rules)
            assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding, want)
            checked += 1
    graphdef, state = nnx.split(model)
    tokens = np.asarray(TOKENS, np.int32)
    if mesh is not None:
        tokens = jax.make_array_from_callback(tokens.shape, sharding.replicated(mesh), lambda i: tokens[i])
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
    logits = multihost_utils.process_allgather(logits, tiled=True) if mesh is not None else np.asarray(logits)
    pid = jax.process_index()
    np.save(f"{out}.{pid}.npy", np.asarray(logits, np.float32))
    with open(f"{out}.{pid}.json", "w") as f:
        json.dump({"mode": mode, "process": pid, "peak_rss": peak, "rss_before": rss_before,
                   "bytes_read": counted["bytes"], "param_bytes": param_bytes, "device_bytes": device_bytes, "shardings_checked": checked,
                   "local_devices": jax.local_device_count()}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_load(hf_dir: str, out: str, mode: str, env: dict | None = None, timeout: float = 1800,
             dtype: str | None = None) -> list[dict]:
    """Runs one load (two processes for mode "two") and returns each process's report."""
    base = [sys.executable, "-m", "benchmarks.bench_load", "worker", hf_dir, out, mode]
    extra = ["--dtype", dtype] if dtype else []
    if mode == "two":
        port = str(_free_port())
        cmds = [base + [port, str(pid)] + extra for pid in range(2)]
    else:
        cmds = [base + extra]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"{' '.join(p.args)} failed:\n{err[-3000:]}")
    reports = []
    for pid in range(len(cmds)):
        with open(f"{out}.{pid}.json") as f:
            reports.append(json.load(f))
    return reports


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("workdir", "/tmp/dsv3_load", "where the synthetic folder and the reports go", flag_values=fv)
    flags.DEFINE_float("size-gb", 1.0, "GB of tensors in the synthetic folder", flag_values=fv)
    flags.DEFINE_boolean("fp8", False, "the released FP8 format (e4m3 + block scales)", flag_values=fv)
    flags.DEFINE_boolean("keep", False, "keep the synthetic folder", flag_values=fv)


def define_worker_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("dtype", None, "parameter dtype to load in (default: the checkpoint's)", flag_values=fv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # run_load's processes: worker HF_DIR OUT MODE [PORT PROCESS_ID] [--dtype D]
        a = cli.parse(define_worker_flags, argv[1:], __doc__, rest=True)
        hf_dir, out, mode, *ids = a.rest
        worker(hf_dir, out, mode, *map(int, ids), dtype=a.dtype)
        return 0
    import numpy as np

    from benchmarks.make_synthetic_checkpoint import bench_config, layers_for_size, make_checkpoint

    args = cli.parse(define_flags, argv, __doc__)
    tag = f"{args.size_gb:g}gb{'_fp8' if args.fp8 else ''}"
    hf = os.path.join(args.workdir, tag)
    if not os.path.exists(os.path.join(hf, "config.json")):
        layers = layers_for_size(args.size_gb * 1e9, "float8_e4m3fn" if args.fp8 else "bfloat16")
        print(f"writing {hf}: {layers} layers", flush=True)
        make_checkpoint(bench_config(layers), hf, use_fp8=args.fp8)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = os.path.join(args.workdir, "report")
    results = {}
    for mode in ("unsharded", "two", "one8", "one8_fsdp"):
        results[mode] = run_load(hf, f"{out}_{mode}", mode, env)
        for r in results[mode]:
            print(f"{mode:9s} process {r['process']}: peak RSS {r['peak_rss'] / 1e9:.2f} GB (before loading "
                  f"{r['rss_before'] / 1e9:.2f} GB), read {r['bytes_read'] / 1e9:.2f} GB, its devices hold "
                  f"{r['device_bytes'] / 1e9:.2f} GB, "
                  f"{r['shardings_checked']} shardings checked", flush=True)
    ref = np.load(f"{out}_unsharded.0.npy")
    model_bytes = results["unsharded"][0]["param_bytes"]
    for mode in ("two", "one8", "one8_fsdp"):
        diff = max(float(np.max(np.abs(np.load(f"{out}_{mode}.{i}.npy") - ref))) for i in range(len(results[mode])))
        print(f"{mode}: max |logits - unsharded| = {diff:.3g}")
    unsharded = results["unsharded"][0]["peak_rss"]
    worst = max(r["peak_rss"] for r in results["two"])
    one8 = results["one8"][0]
    load_peak = one8["peak_rss"] - one8["rss_before"]
    print(f"model {model_bytes / 1e9:.3f} GB; two processes: worst peak / unsharded peak = {worst / unsharded:.3f} "
          f"(need < 0.6)\none process on 8 devices: (peak - RSS before loading) / model bytes = "
          f"{load_peak / model_bytes:.3f} (need < 1.3); of which the devices' shards "
          f"{one8['device_bytes'] / model_bytes:.3f} (non-expert parameters x4 over the expert axis) and staging "
          f"{(load_peak - one8['device_bytes']) / model_bytes:.3f}; raw peak / model bytes "
          f"{one8['peak_rss'] / model_bytes:.3f} (RSS before loading {one8['rss_before'] / 1e9:.3f} GB)")
    fsdp8 = results["one8_fsdp"][0]
    print(f"one process on 8 devices, fsdp=8 (no replication): raw peak / model bytes "
          f"{fsdp8['peak_rss'] / model_bytes:.3f} (need < 1.3); its devices hold "
          f"{fsdp8['device_bytes'] / model_bytes:.3f}")
    if not args.keep:
        import shutil

        shutil.rmtree(hf, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

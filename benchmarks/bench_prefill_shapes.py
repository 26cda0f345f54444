"""What varied prompt lengths cost `generate()` in compiles: 24 prompts of varied lengths against 24
of one length (their mean), each set in a fresh process, so every compile it meets is paid.

    python -m benchmarks.bench_prefill_shapes [--prompts=24] [--max_tokens=16] [--longest=900]

The model is a small random one (3 layers, hidden 256, 16 experts, fp32, 2048 ids, the
bench_serve model). Varied lengths are spread evenly over 8 .. --longest; both sets hold the same
number of prompt tokens. Each prompt is one `generate()` call (batch 1, greedy, --max_tokens new
tokens, the default prefill chunk). Prints each set's wall time, process CPU time (steadier than
wall time on a shared machine), compiles (traces) and the ratio (target: varied within 2x of one
length). The workers run without a persistent compilation cache (JAX_COMPILATION_CACHE_DIR unset).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import flags

from dsv3_jax import cli


def lengths_for(kind: str, prompts: int, longest: int) -> list[int]:
    varied = np.linspace(8, longest, prompts).astype(int).tolist()
    return varied if kind == "varied" else [int(np.mean(varied))] * prompts


def worker(kind: str, prompts: int, max_tokens: int, longest: int) -> dict:
    from flax import nnx

    from dsv3_jax import DeepSeekV3
    from dsv3_jax.inference import Generation
    from benchmarks.make_synthetic_checkpoint import bench_config

    cfg = bench_config(3, vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                       num_routed_experts=16, num_expert_groups=4, num_mtp_layers=0, param_dtype="float32",
                       compute_dtype="float32", max_position_embeddings=1024)
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    traces = 0
    start, cpu = time.perf_counter(), time.process_time()
    for n in lengths_for(kind, prompts, longest):
        gen = Generation(model, rng.integers(3, 2048, (1, n)).astype(np.int32), max_tokens)
        for _ in gen:
            pass
        traces += gen.stats.prefill_traces + gen.stats.decode_traces
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu, "traces": traces}


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("prompts", 24, "prompts per set", flag_values=fv)
    flags.DEFINE_integer("max_tokens", 16, "new tokens per prompt", flag_values=fv)
    flags.DEFINE_integer("longest", 900, "longest varied prompt (the model holds 1024)", flag_values=fv)
    flags.DEFINE_enum("worker", None, ["varied", "same"], "internal: the prompts one worker process serves",
                      flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    if args.worker:
        print(json.dumps(worker(args.worker, args.prompts, args.max_tokens, args.longest)))
        return 0
    results = {}
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # every compile paid
    for kind in ("same", "varied"):
        cmd = [sys.executable, "-m", "benchmarks.bench_prefill_shapes", f"--worker={kind}",
               f"--prompts={args.prompts}", f"--max_tokens={args.max_tokens}", f"--longest={args.longest}"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
        results[kind] = json.loads(out.strip().splitlines()[-1])
        lengths = lengths_for(kind, args.prompts, args.longest)
        print(f"{kind:6s} lengths {min(lengths)}..{max(lengths)}: {results[kind]['seconds']:.1f}s "
              f"({results[kind]['cpu_seconds']:.1f}s CPU), {results[kind]['traces']} compiles", flush=True)
    ratio = results["varied"]["seconds"] / results["same"]["seconds"]
    cpu_ratio = results["varied"]["cpu_seconds"] / results["same"]["cpu_seconds"]
    print(f"varied / one length: {ratio:.2f}x ({cpu_ratio:.2f}x CPU) (target <= 2x): "
          f"{'PASS' if ratio <= 2 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

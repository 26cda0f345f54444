"""Prefill peak memory against prompt length: chunked prefill into the latent cache.

    python -m benchmarks.bench_long_prompt [--lengths=4096,8192,16384,32768] [--chunk=2048] [--layers=3]

Each length runs in a fresh process (so peaks do not carry over): a tiny model, one prompt of that
length, chunked prefill and one generated token. Prints the process's peak RSS, its growth over the
RSS before the prompt (model, jax runtime), the latent cache's own size, and the growth ratio from
one length to the next: 2 when memory grows linearly with the prompt, 4 when quadratically (the
[B, H, T, T] scores of a one-pass prefill). Timings are printed as seconds per prompt token.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

from absl import flags

from dsv3_jax import cli


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(length: int, chunk: int, layers: int) -> dict:
    import numpy as np
    from flax import nnx

    from dsv3_jax import DeepSeekV3, ModelConfig
    from dsv3_jax.inference import Generation, cache_bytes_per_token

    cfg = ModelConfig.tiny(num_layers=layers, num_dense_layers=1, num_mtp_layers=0,
                           max_position_embeddings=length + 16)
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, length)).astype(np.int32)
    gen = Generation(model, prompt, 1, prefill_chunk=chunk, cache_dtype="float32")
    before = _rss_mb()
    start = time.perf_counter()
    list(gen)
    seconds = time.perf_counter() - start
    slots = next(s for s in gen.cache if s is not None).latent.shape[2]
    cache_mb = cache_bytes_per_token(cfg, "float32") * cfg.num_layers * slots / 2**20
    return {"length": length, "before_mb": before, "peak_mb": _rss_mb(), "cache_mb": cache_mb,
            "seconds": seconds, "chunks": gen.stats.prefill_chunks}


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_list("lengths", "4096,8192,16384,32768", "prompt lengths, comma-separated", flag_values=fv)
    flags.DEFINE_integer("chunk", 2048, "prefill chunk (tokens per step)", flag_values=fv)
    flags.DEFINE_integer("layers", 3, "layers of the tiny model", flag_values=fv)
    flags.DEFINE_integer("worker", None, "internal: the prompt length one worker process measures",
                         flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.numbers(args, "lengths")
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.chunk, args.layers)))
        return 0
    print(f"tiny config, {args.layers} layers, chunk {args.chunk}, float32 cache; one process per length")
    print(f"{'prompt':>8} {'chunks':>6} {'peak RSS MB':>12} {'growth MB':>10} {'cache MB':>9} "
          f"{'growth ratio':>12} {'s/token':>9}")
    prev = None
    for length in args.lengths:
        cmd = [sys.executable, "-m", "benchmarks.bench_long_prompt", f"--worker={length}", f"--chunk={args.chunk}",
               f"--layers={args.layers}"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        growth = r["peak_mb"] - r["before_mb"]
        ratio = f"{growth / prev:.2f}" if prev else "-"
        print(f"{length:8d} {r['chunks']:6d} {r['peak_mb']:12.1f} {growth:10.1f} {r['cache_mb']:9.1f} {ratio:>12} "
              f"{r['seconds'] / length:9.2e}", flush=True)
        prev = growth
    print("growth ratio per doubling of the prompt: 2 = linear, 4 = quadratic")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode-step time against cache length (absorbed MLA over the latent cache).

    python -m benchmarks.bench_decode [--lengths=512,2048,8192,32768] [--batch=8] \
        [--cache_dtype=bfloat16] [--attention_impl=xla] [--num_heads=16] [--kv_lora_rank=512]
    python -m benchmarks.bench_decode --compare --lengths=2048 --batch=2   # fp8 vs bf16 cache, XLA and Pallas

Builds a randomly initialised model (MLA at the 671B latent sizes, small everywhere else, so that
the step is dominated by attention over the cache), fills a cache of each length and times one
jitted decode step (one new token per row attending to every slot). Prints ms per step, the cache
bytes per token per layer, the per-slot slope and the fit of a straight line. `--compare` times the
bf16 and the fp8 cache on both attention paths side by side in one process and prints the ratios
and the cache bytes one step reads per generated token.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from dsv3_jax import DeepSeekV3, ModelConfig, cli, host
from dsv3_jax.inference import cache_bytes_per_token, init_cache


def bench_config(args) -> ModelConfig:
    return ModelConfig.tiny(
        vocab_size=1024, hidden_size=args.hidden_size, num_heads=args.num_heads, q_lora_rank=None,
        kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_layers=args.num_layers, num_dense_layers=args.num_layers, num_mtp_layers=0,
        max_position_embeddings=max(args.lengths) + 1, compute_dtype=args.compute_dtype,
        attention_impl=args.attention_impl)


def time_step(step, state, cache, tokens, positions, repeats: int) -> float:
    cache = step(state, cache, tokens, positions)[1]  # compile
    jax.block_until_ready(cache)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        logits, cache = step(state, cache, tokens, positions)
        jax.block_until_ready(logits)
        best = min(best, time.perf_counter() - start)
    return best


def make_step(graphdef):
    @jax.jit
    def step(state, cache, tokens, positions):
        out = nnx.merge(graphdef, state).forward(tokens, positions=positions[:, None], with_mtp=False, cache=cache)
        return out.logits, out.cache

    return step


def filled_cache(cfg, batch: int, length: int, cache_dtype: str):
    """A cache of `length` slots holding random entries in the cache's layout (fp8: quantised)."""
    from dsv3_jax.ops.latent_attention import encode

    cache = init_cache(cfg, batch, length, cache_dtype)
    keys = jax.random.split(jax.random.key(1), 2)

    def fill(stack):
        latent = jax.random.normal(keys[0], stack.latent.shape, jnp.float32)
        k_pe = jax.random.normal(keys[1], stack.k_pe.shape, jnp.float32)
        layers = [encode(latent[i], k_pe[i], cache_dtype) for i in range(latent.shape[0])]
        return type(stack)(*(None if parts[0] is None else jnp.stack(parts) for parts in zip(*layers)))

    return jax.tree.map(fill, cache, is_leaf=lambda x: hasattr(x, "latent_scale"))


def compare(args) -> None:
    print(f"{'length':>7} {'path':>7} {'bf16 ms':>9} {'fp8 ms':>9} {'fp8/bf16':>9} "
          f"{'bf16 B/token':>13} {'fp8 B/token':>12} {'bytes ratio':>11}")
    tokens = jnp.ones((args.batch, 1), jnp.int32)
    for length in args.lengths:
        for impl in ("xla", "pallas"):
            args.attention_impl = impl
            cfg = bench_config(args)
            graphdef, state = nnx.split(DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
            step, positions = make_step(graphdef), jnp.full((args.batch,), length - 1, jnp.int32)
            ms, read = {}, {}
            for dtype in ("bfloat16", "float8"):
                cache = filled_cache(cfg, args.batch, length, dtype)
                ms[dtype] = 1e3 * time_step(step, state, cache, tokens, positions, args.repeats)
                # every row reads the slots before its position, in every layer
                read[dtype] = cache_bytes_per_token(cfg, dtype) * cfg.num_layers * (length - 1)
            print(f"{length:7d} {impl:>7} {ms['bfloat16']:9.2f} {ms['float8']:9.2f} "
                  f"{ms['float8'] / ms['bfloat16']:9.3f} {read['bfloat16']:13d} {read['float8']:12d} "
                  f"{read['float8'] / read['bfloat16']:11.3f}", flush=True)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_list("lengths", "512,2048,8192,32768", "cache lengths to decode at, comma-separated", flag_values=fv)
    flags.DEFINE_integer("batch", 8, "rows decoded at once", flag_values=fv)
    flags.DEFINE_enum("cache_dtype", "bfloat16", ["float32", "bfloat16", "float8", "int8"], "latent cache dtype",
                      flag_values=fv)
    flags.DEFINE_string("compute_dtype", None, "default: bfloat16, float32 on CPU", flag_values=fv)
    flags.DEFINE_enum("attention_impl", "xla", ["xla", "pallas"], "attention path", flag_values=fv)
    flags.DEFINE_integer("hidden_size", 256, "model dimension", flag_values=fv)
    flags.DEFINE_integer("num_heads", 16, "attention heads", flag_values=fv)
    flags.DEFINE_integer("kv_lora_rank", 512, "latent (cache) width", flag_values=fv)
    flags.DEFINE_integer("num_layers", 2, "layers", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "timed steps per length (median)", flag_values=fv)
    flags.DEFINE_boolean("compare", False, "bf16 vs fp8 cache on the XLA and Pallas paths", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.numbers(args, "lengths")
    args.compute_dtype = args.compute_dtype or ("float32" if host.on_cpu() else "bfloat16")
    if args.compare:
        return compare(args)
    cfg = bench_config(args)
    graphdef, state = nnx.split(DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    step = make_step(graphdef)

    print(f"backend {jax.default_backend()}, batch {args.batch}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
          f"latent {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}, cache {args.cache_dtype}: "
          f"{cache_bytes_per_token(cfg, args.cache_dtype)} bytes per token per layer "
          f"(671B preset: {cache_bytes_per_token(ModelConfig.deepseek_v3(), args.cache_dtype)})")
    tokens = jnp.ones((args.batch, 1), jnp.int32)
    times = []
    for length in args.lengths:
        cache = init_cache(cfg, args.batch, length, args.cache_dtype)
        cache = jax.tree.map(lambda a: jax.random.normal(jax.random.key(1), a.shape).astype(a.dtype), cache)
        positions = jnp.full((args.batch,), length - 1, jnp.int32)  # every slot visible
        times.append(time_step(step, state, cache, tokens, positions, args.repeats))
        print(f"cache length {length:7d}: {times[-1] * 1e3:9.3f} ms per decode step", flush=True)
    lengths, t = np.array(args.lengths, float), np.array(times)
    slope, intercept = np.polyfit(lengths, t, 1)
    r2 = 1 - np.sum((t - (slope * lengths + intercept)) ** 2) / np.sum((t - t.mean()) ** 2)
    print(f"linear fit: {intercept * 1e3:.3f} ms + {slope * 1e9:.2f} ns per slot (R^2 = {r2:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

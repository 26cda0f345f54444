"""Prefill and decode cost against context length, dense MLA vs DeepSeek Sparse Attention (V3.2).

    python -m benchmarks.bench_dsa [--contexts=128,256,512,1024,2048] [--topk=64] [--batch=2] [--repeats=3]

(a) The abstract 671B (`ModelConfig.deepseek_v3_2()`, dense = the same with no indexer), per
sequence over its 61 layers, contexts 4K .. 128K: a roofline estimate max(FLOPs / peak,
bytes / bandwidth) on one H200 (989 TFLOP/s bf16, 4.8 TB/s) of the attention alone, as this
package computes it: dense prefill in the expanded form (causal, per-head keys and values), dense
decode absorbed over every cached row (bf16 cache: `cache_bytes_per_token`); DSA as the cached
path runs it: a prompt of at most topk tokens dense, a longer one as one call whose every query
scores the indexer (I heads of K dims) over every cache slot and own entry, masked after rather
than skipped, and attends to topk gathered rows. Nothing is run for (a).

(b) Measured on this host: a scaled-down model (attention-heavy: 16 heads, latent 256; index_topk
`--topk`, 4 index heads of 64) with random weights, one jitted call per context: prefill = the
whole context as one call into an empty fp32 cache; decode = one token per row at the last
position of a cache of random entries (the step `generate` runs). Best of `--repeats`.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from dsv3_jax import DeepSeekV3, ModelConfig, cli
from dsv3_jax.inference import cache_bytes_per_token, init_cache

H200_FLOPS, H200_BYTES_PER_S = 989e12, 4.8e12
ABSTRACT_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)


def no_indexer(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(index_n_heads=0, index_head_dim=0, index_topk=0)


def attention_cost(cfg: ModelConfig, context: int, decode: bool) -> tuple[float, float]:
    """(FLOPs, bytes read) of one layer's attention for one sequence: the token at `context` (decode)
    or the `context` tokens of a prompt as one call (prefill), dense or, with an indexer, sparse
    (module docstring)."""
    h, c, r = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    row_bytes = cache_bytes_per_token(no_indexer(cfg), "bfloat16")
    absorbed_flops = 2 * h * (2 * c + r)  # per (query, row): q_lat . c, q_pe . k_pe, then p @ c
    if decode:
        if not cfg.has_indexer:
            return absorbed_flops * context, context * row_bytes
        kept = min(context, cfg.index_topk)
        index_flops = 2 * cfg.index_n_heads * cfg.index_head_dim * context
        return index_flops + absorbed_flops * kept, context * cfg.index_head_dim * 2 + kept * row_bytes
    if not cfg.has_indexer or context <= cfg.index_topk:  # no query sees more than index_topk: dense
        flops = 2 * h * (cfg.qk_head_dim + cfg.v_head_dim) * context * (context + 1) / 2  # expanded, causal
        return flops, float(context * row_bytes)
    # one call into a cache of `context` slots, as `cached_topk` and `attend_sparse` run it: the indexer
    # scores every query against every cache slot and every own entry (masked after, not skipped), and
    # each query attends to index_topk gathered rows
    flops = 2 * cfg.index_n_heads * cfg.index_head_dim * context * 2 * context
    flops += absorbed_flops * context * cfg.index_topk
    nbytes = context * row_bytes + context * cfg.index_topk * row_bytes  # the cache, then the gathered rows
    return flops, nbytes


def roofline_ms(cfg: ModelConfig, context: int, decode: bool) -> float:
    flops, nbytes = attention_cost(cfg, context, decode)
    return 1e3 * cfg.num_layers * max(flops / H200_FLOPS, nbytes / H200_BYTES_PER_S)


def print_abstract(out=sys.stdout) -> None:
    dsa = ModelConfig.deepseek_v3_2()
    print(f"(a) 671B attention, {dsa.num_layers} layers, one sequence, H200 roofline (ms); index_topk "
          f"{dsa.index_topk}, indexer {dsa.index_n_heads} x {dsa.index_head_dim}", file=out)
    print(f"{'context':>8} {'prefill dense':>14} {'prefill DSA':>12} {'decode dense':>13} {'decode DSA':>11}", file=out)
    for length in ABSTRACT_CONTEXTS:
        cells = [roofline_ms(cfg, length, decode) for decode in (False, True) for cfg in (no_indexer(dsa), dsa)]
        print(f"{length:>8} {cells[0]:>14.2f} {cells[1]:>12.2f} {cells[2]:>13.4f} {cells[3]:>11.4f}", file=out)


def bench_config(topk: int, max_context: int) -> ModelConfig:
    return ModelConfig.tiny(vocab_size=256, hidden_size=256, num_heads=16, kv_lora_rank=256, qk_nope_head_dim=64,
                            qk_rope_head_dim=32, v_head_dim=64, num_layers=1, num_dense_layers=1, num_mtp_layers=0,
                            index_n_heads=4, index_head_dim=64, index_topk=topk, yarn=None,
                            max_position_embeddings=max_context)


def _best(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def _step(cfg: ModelConfig):
    graphdef, state = nnx.split(DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    step = jax.jit(lambda s, cache, tokens, pos: nnx.merge(graphdef, s).forward(tokens, positions=pos, with_mtp=False,
                                                                                 cache=cache).logits)
    return functools.partial(step, state)


def prefill_ms(cfg: ModelConfig, context: int, batch: int, repeats: int) -> float:
    """The whole context as one call into an empty cache."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, context)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(context), (batch, context))
    step, empty = _step(cfg), init_cache(cfg, batch, context, "float32")
    return _best(lambda: step(empty, tokens, positions), repeats)


def decode_ms(cfg: ModelConfig, context: int, batch: int, repeats: int) -> float:
    """One token per row at the last position of a cache of `context` random entries."""
    cache = init_cache(cfg, batch, context, "float32")
    leaves, treedef = jax.tree.flatten(cache)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    cache = jax.tree.unflatten(treedef, [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)])
    step, tokens = _step(cfg), jnp.ones((batch, 1), jnp.int32)
    return _best(lambda: step(cache, tokens, jnp.full((batch, 1), context - 1)), repeats)


def print_measured(prefill_contexts, decode_contexts, topk: int, batch: int, decode_batch: int, repeats: int,
                   out=sys.stdout) -> None:
    dsa = bench_config(topk, max(*prefill_contexts, *decode_contexts))
    dense = no_indexer(dsa)
    print(f"(b) measured on {jax.devices()[0].platform}: {dsa.num_heads} heads, latent {dsa.kv_lora_rank}, "
          f"index_topk {topk}, one layer, fp32 cache (ms, best of {repeats})", file=out)
    print(f"prefill, batch {batch}\n{'context':>8} {'dense':>10} {'DSA':>10}", file=out)
    for length in prefill_contexts:
        print(f"{length:>8} {prefill_ms(dense, length, batch, repeats):>10.2f} "
              f"{prefill_ms(dsa, length, batch, repeats):>10.2f}", file=out, flush=True)
    print(f"decode, batch {decode_batch}\n{'context':>8} {'dense':>10} {'DSA':>10}", file=out)
    for length in decode_contexts:
        print(f"{length:>8} {decode_ms(dense, length, decode_batch, repeats):>10.3f} "
              f"{decode_ms(dsa, length, decode_batch, repeats):>10.3f}", file=out, flush=True)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_list("contexts", ["128", "256", "512", "1024", "2048"], "measured prefill lengths", flag_values=fv)
    flags.DEFINE_list("decode_contexts", ["128", "256", "512", "1024", "2048", "4096", "8192"],
                      "measured decode cache lengths", flag_values=fv)
    flags.DEFINE_integer("topk", 64, "index_topk of the measured model", flag_values=fv)
    flags.DEFINE_integer("batch", 1, "rows per prefill call", flag_values=fv)
    flags.DEFINE_integer("decode_batch", 8, "rows per decode step", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "timed calls per cell (the best is printed)", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    print_abstract()
    print_measured([int(c) for c in args.contexts], [int(c) for c in args.decode_contexts], args.topk, args.batch,
                   args.decode_batch, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())

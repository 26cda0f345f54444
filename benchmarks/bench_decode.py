"""Decode-step time against cache length (absorbed MLA over the latent cache).

    python -m benchmarks.bench_decode [--lengths=512,2048,8192,32768] [--batch=8] \
        [--cache_dtype=bfloat16] [--attention_impl=xla] [--num_heads=16] [--kv_lora_rank=512]
    python -m benchmarks.bench_decode --compare --lengths=2048 --batch=2   # fp8 vs bf16 cache, XLA and Pallas
    python -m benchmarks.bench_decode --paged [--page_size=128] [--short=512] [--long=32768] [--sums=10240,40960]
    python -m benchmarks.bench_decode --paged --index_topk=2048   # V3.2: the lightning indexer, sparse attention

Builds a randomly initialised model (MLA at the 671B latent sizes, small everywhere else, so that
the step is dominated by attention over the cache), fills a cache of each length and times one
jitted decode step (one new token per row attending to every slot). Prints ms per step, the cache
bytes per token per layer, the per-slot slope and the fit of a straight line. `--compare` times the
bf16 and the fp8 cache on both attention paths side by side in one process and prints the ratios
and the cache bytes one step reads per generated token.

`--paged`: a paged cache (a pool of pages at shuffled ids, `ModelCache.page_table`) against the
contiguous one, rows of different lengths in one step. First 15 rows of --short tokens plus one of
--long: the step, the step without the long row, the long row decoded alone (paged, where one row
reads one page per loop trip, and contiguous), the ratio of the first to the sum of the second and
the faster third (target <= 1.5: each row reads its own pages), and the same step
on a contiguous cache of 16 x --long slots (every row reads up to the longest row). Then a table:
for each sum in --sums, rows of equal sum and different longest rows (16, 4 and 1 equal rows; 15 of
--short and one long), paged and contiguous step times; a straight line of the paged times against
the sum of the rows and of the contiguous times against batch x the longest row, with their fits.
Cases are timed in rounds that run each once (best of --repeats), so load on a shared host weighs
on them alike. `--index_topk`: the model is V3.2's (the indexer scores each row's cached keys, the
query attends to its best --index_topk). On CPU pass --cache_dtype=float32: XLA:CPU widens a bf16
cache to fp32 around the step's write, a copy of the whole cache (or pool) every step that no TPU or
GPU program makes.
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

from dsv3_jax import DeepSeekV3, ModelConfig, cli, host
from dsv3_jax.inference import cache_bytes_per_token, init_cache


def bench_config(args) -> ModelConfig:
    return ModelConfig.tiny(
        vocab_size=1024, hidden_size=args.hidden_size, num_heads=args.num_heads,
        q_lora_rank=1536 if args.index_topk else None,  # V3.2's indexer reads the query latent
        kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_layers=args.num_layers, num_dense_layers=args.num_layers, num_mtp_layers=0,
        max_position_embeddings=max(args.lengths) + 1, compute_dtype=args.compute_dtype,
        attention_impl=args.attention_impl, index_topk=args.index_topk,
        index_n_heads=args.index_heads if args.index_topk else 0,
        index_head_dim=args.index_dim if args.index_topk else 0)


def time_steps(step, state, cases: dict, repeats: int) -> dict:
    """{name: seconds} of one step of each case (cache, tokens, positions): the best of `repeats`
    rounds, each round running every case once, in an order turned each round, so that load on a
    shared host weighs on every case alike."""
    caches = {name: step(state, *case)[1] for name, case in cases.items()}  # compile
    jax.block_until_ready(caches)
    best, names = dict.fromkeys(cases, float("inf")), list(cases)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            logits, caches[name] = step(state, caches[name], *cases[name][1:])
            jax.block_until_ready(logits)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def time_step(step, state, cache, tokens, positions, repeats: int) -> float:
    return time_steps(step, state, {0: (cache, tokens, positions)}, repeats)[0]


def make_step(graphdef):
    @functools.partial(jax.jit, donate_argnums=1)  # the cache updated in place, as the server's steps do
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


def random_cache(cfg, batch: int, slots: int, cache_dtype: str):
    """`init_cache`'s arrays holding pseudo-random entries in its layout's dtypes: sin of a hash of
    each element's index, computed where it is stored (a random generator's bits and a zero cache
    beside a 2 GB cache would take several times its memory)."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, batch, slots, cache_dtype))

    def draw(a):
        index = sum(jax.lax.broadcasted_iota(jnp.float32, a.shape, d) * (12.9898 + 78.233 * d) for d in range(a.ndim))
        return jnp.sin(index).astype(a.dtype)

    return jax.jit(lambda: jax.tree.map(draw, shapes))()


def paged_cache(cfg, lengths_B, page_size: int, num_pages: int, table_width: int, cache_dtype: str):
    """A pool of `num_pages` pages of random entries and a table [B, table_width] giving row b the
    ceil(lengths_B[b] / page_size) pages its decode step reads and writes, at shuffled ids."""
    pages_B = -(-np.asarray(lengths_B) // page_size)
    ids = np.random.default_rng(0).permutation(num_pages)
    table_BxM = np.full((len(lengths_B), table_width), -1, np.int32)
    for b, (start, n) in enumerate(zip(np.cumsum(pages_B) - pages_B, pages_B)):
        table_BxM[b, :n] = ids[start:start + n]
    pool = random_cache(cfg, num_pages, page_size, cache_dtype)
    return pool._replace(page_table=jnp.asarray(table_BxM))


def rows_case(cfg, args, lengths_B, paged: bool) -> tuple:
    """(cache, tokens, positions) of a decode step of rows at positions lengths_B - 1, every earlier
    slot visible: paged (a pool sized to the run's largest sum, one table width: one compile per
    batch size) or contiguous (B rows of the longest)."""
    if paged:
        cache = paged_cache(cfg, lengths_B, args.page_size, args.pool_pages, -(-max(args.lengths) // args.page_size),
                            args.cache_dtype)
    else:
        cache = random_cache(cfg, len(lengths_B), max(lengths_B), args.cache_dtype)
    return cache, jnp.ones((len(lengths_B), 1), jnp.int32), jnp.asarray(lengths_B, jnp.int32) - 1


def mixes(args) -> list[list[int]]:
    """Rows of each sum in --sums: 16, 4 and 1 equal rows, and 15 of --short with one long row."""
    out = []
    for total in args.sums:
        out += [[total // n] * n for n in (16, 4, 1)]
        if total > 15 * args.short:
            out.append([args.short] * 15 + [total - 15 * args.short])
    return out


def fit(x, t) -> str:
    slope, intercept = np.polyfit(x, t, 1)
    r2 = 1 - np.sum((t - (slope * x + intercept)) ** 2) / np.sum((t - t.mean()) ** 2)
    return f"{intercept * 1e3:.2f} ms + {slope * 1e9:.2f} ns per token (R^2 = {r2:.3f})"


def paged(args) -> None:
    mixed = [args.short] * 15 + [args.long]
    table = mixes(args)
    args.lengths = [args.long] + [max(m) for m in table]
    args.pool_pages = max(sum(-(-n // args.page_size) for n in m) for m in table + [mixed])
    cfg = bench_config(args)
    graphdef, state = nnx.split(DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    step = make_step(graphdef)
    print(f"backend {jax.default_backend()}, {cfg.num_layers} layers, {cfg.num_heads} heads, latent "
          f"{cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}, cache {args.cache_dtype}, pages of {args.page_size}, "
          f"a pool of {args.pool_pages} pages; best of {args.repeats} rounds (ms)", flush=True)
    cases = {name: rows_case(cfg, args, rows, is_paged) for name, rows, is_paged in (
        ("mixed", mixed, True), ("short", mixed[:15], True), ("long", mixed[15:], True),
        ("long contiguous", mixed[15:], False), ("contiguous", mixed, False))}
    ms = {name: 1e3 * t for name, t in time_steps(step, state, cases, args.repeats).items()}
    del cases
    alone = min(ms["long"], ms["long contiguous"])  # one row reads one page per loop trip: the faster of the two
    ratio = ms["mixed"] / (ms["short"] + alone)
    print(f"15 x {args.short} + 1 x {args.long}, paged: {ms['mixed']:.2f}; without the long row {ms['short']:.2f}, "
          f"the long row alone {ms['long']:.2f} (contiguous {ms['long contiguous']:.2f}): {ratio:.2f}x the sum with "
          f"the faster (target <= 1.5: {'PASS' if ratio <= 1.5 else 'FAIL'}); contiguous 16 x {args.long}: "
          f"{ms['contiguous']:.2f} ({ms['contiguous'] / ms['mixed']:.1f}x the paged step)", flush=True)
    print(f"\n{'rows':>22} {'sum':>7} {'B x longest':>11} {'paged ms':>9} {'contiguous ms':>13}")
    # the paged rows in alternating rounds (their fit is the claim); each contiguous row alone (memory)
    t = time_steps(step, state, {(i, True): rows_case(cfg, args, lengths, True) for i, lengths in enumerate(table)},
                   args.repeats)
    for i, lengths in enumerate(table):
        t |= time_steps(step, state, {(i, False): rows_case(cfg, args, lengths, False)}, args.repeats)
    rows = []
    for i, lengths in enumerate(table):
        rows.append((sum(lengths), len(lengths) * max(lengths), t[i, True], t[i, False]))
        text = " + ".join(f"{lengths.count(n)} x {n}" for n in sorted(set(lengths)))
        print(f"{text:>22} {rows[-1][0]:7d} {rows[-1][1]:11d} {1e3 * t[i, True]:9.2f} {1e3 * t[i, False]:13.2f}")
    total, padded, t_paged, t_contiguous = (np.array(c, float) for c in zip(*rows))
    if len(set(total)) < 2:
        return  # one sum: no line to fit
    print(f"paged against the sum of the rows: {fit(total, t_paged)}; against B x longest: {fit(padded, t_paged)}")
    print(f"contiguous against B x longest: {fit(padded, t_contiguous)}; against the sum: {fit(total, t_contiguous)}")


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
    flags.DEFINE_integer("repeats", 5, "timed steps per length (the best)", flag_values=fv)
    flags.DEFINE_boolean("compare", False, "bf16 vs fp8 cache on the XLA and Pallas paths", flag_values=fv)
    flags.DEFINE_boolean("paged", False, "a paged cache against the contiguous one, rows of mixed lengths",
                         flag_values=fv)
    flags.DEFINE_integer("page_size", 128, "--paged: tokens per page", flag_values=fv)
    flags.DEFINE_integer("short", 512, "--paged: the 15 short rows' length", flag_values=fv)
    flags.DEFINE_integer("long", 32768, "--paged: the long row's length", flag_values=fv)
    flags.DEFINE_list("sums", "10240,40960", "--paged: sums of the rows' lengths of the table", flag_values=fv)
    flags.DEFINE_integer("index_topk", 0, "> 0: V3.2's sparse attention (the lightning indexer) keeping this many "
                         "entries a query", flag_values=fv)
    flags.DEFINE_integer("index_heads", 64, "--index_topk: the indexer's heads", flag_values=fv)
    flags.DEFINE_integer("index_dim", 128, "--index_topk: the indexer's head dim", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.numbers(args, "lengths")
    cli.numbers(args, "sums")
    args.compute_dtype = args.compute_dtype or ("float32" if host.on_cpu() else "bfloat16")
    if args.compare:
        return compare(args)
    if args.paged:
        return paged(args)
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
        cache = random_cache(cfg, args.batch, length, args.cache_dtype)
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

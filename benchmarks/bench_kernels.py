"""Benchmarks every pallas_kernels kernel against its jnp reference on the default device.

  python -m benchmarks.bench_kernels [--iters 3] [--decode_len 1024] [--prefill_len 256] ...

Prints per kernel: its largest difference from the reference relative to the reference's largest
value (`err`), kernel and reference time (same run), achieved GB/s and TFLOP/s, and the
fraction of the device's peak (n/a where the device kind is not in the table, e.g. CPU, where
kernels run through the Pallas interpreter and the figures only show that the script works).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

from benchmarks.peaks import achieved, device_peak
from dsv3_jax import cli
import pallas_kernels as pk

def timeit(fn, args, iters):
    jax.block_until_ready(fn(*args))  # compile + warm up
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def rel_err(kernel, ref, args) -> float:
    """max |kernel - ref| / max |ref| over every output leaf, in fp32."""
    worst = 0.0
    for got, want in zip(jax.tree.leaves(kernel(*args)), jax.tree.leaves(ref(*args))):
        got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
        worst = max(worst, float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30)))
    return worst


def compare(name, f, r, args, a, bytes_, flops, fp8, peak):
    print(f"{name:<22} err {rel_err(f, r, args):9.2e}   ", end="")
    report(name, timeit(f, args, a.iters), timeit(r, args, a.iters), bytes_, flops, fp8, peak)


def report(name, t_kernel, t_ref, bytes_, flops, fp8, peak):
    rates = achieved(t_kernel, flops, bytes_, peak, fp8)
    if peak is None:
        frac = "n/a"
    else:
        compute, hbm = rates["frac_compute"], rates["frac_hbm"]
        frac = f"{max(compute, hbm):.1%} (compute {compute:.1%}, hbm {hbm:.1%})"
    print(f"kernel {t_kernel * 1e3:10.2f} ms   ref {t_ref * 1e3:10.2f} ms   "
          f"{rates['gbs']:9.2f} GB/s   {rates['tflops']:8.4f} TFLOP/s   peak {frac}")


def bench_fp8(a, peak):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (a.m, a.k), jnp.float32)
    w = jax.random.normal(kw, (a.n, a.k), jnp.float32)
    args = (*pk.quantize_1x128(x), *pk.quantize_128x128(w))
    f = jax.jit(lambda *o: pk.fp8_matmul(*o, out_dtype=jnp.bfloat16))
    r = jax.jit(lambda *o: pk.fp8_matmul_reference(*o, out_dtype=jnp.bfloat16))
    bytes_ = a.m * a.k + a.n * a.k + 2 * a.m * a.n
    compare("fp8_matmul", f, r, args, a, bytes_, 2 * a.m * a.n * a.k, True, peak)


def bench_grouped(a, peak):
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (a.m, a.k), jnp.float32)
    w = jax.random.normal(kw, (a.groups, a.n, a.k), jnp.float32)
    wq, ws = jax.vmap(pk.quantize_128x128)(w)
    sizes = jnp.full((a.groups,), a.m // a.groups, jnp.int32)
    args = (*pk.quantize_1x128(x), wq, ws, sizes)
    f = jax.jit(lambda *o: pk.fp8_grouped_matmul(*o, out_dtype=jnp.bfloat16))
    r = jax.jit(lambda *o: pk.fp8_grouped_matmul_reference(*o, out_dtype=jnp.bfloat16))
    bytes_ = a.m * a.k + a.groups * a.n * a.k + 2 * a.m * a.n
    compare("fp8_grouped_matmul", f, r, args, a, bytes_, 2 * a.m * a.n * a.k, True, peak)


def bench_decode(a, peak):
    b, h, r_, p, s = a.batch, a.heads, 512, 64, a.decode_len
    ks = jax.random.split(jax.random.key(2), 4)
    shapes = [(b, h, r_), (b, h, p), (b, s, r_), (b, s, p)]
    args = [jax.random.normal(k, sh, jnp.float32).astype(jnp.bfloat16) for k, sh in zip(ks, shapes)]
    args.append(jnp.full((b,), s, jnp.int32))
    f = jax.jit(lambda *o: pk.mla_decode(*o, softmax_scale=192 ** -0.5))
    ref = jax.jit(lambda *o: pk.mla_decode_reference(*o, softmax_scale=192 ** -0.5))
    bytes_ = 2 * b * s * (r_ + p)  # the latent cache read once
    compare("mla_decode", f, ref, args, a, bytes_, 2 * b * h * s * (2 * r_ + p), False, peak)


def bench_sparse(a, peak):
    """DSA decode: the indexer's scores over the whole index-key cache (64 heads of dim 128), then
    the absorbed decode over the top `--topk` rows (at most the cache length)."""
    b, h, r_, p, s, k = a.batch, a.heads, 512, 64, a.decode_len, min(a.topk, a.decode_len)
    ks = jax.random.split(jax.random.key(4), 8)
    shapes = [(b, 64, 128), (b, 64), (b, s, 128)]
    idx_args = [jax.random.normal(kk, sh, jnp.float32).astype(jnp.bfloat16) for kk, sh in zip(ks[:3], shapes)]
    idx_args.append(jnp.full((b,), s, jnp.int32))
    compare("indexer_scores", jax.jit(pk.indexer_scores), jax.jit(pk.indexer_scores_reference), idx_args, a,
            2 * b * s * 128, 2 * b * 64 * s * 128, False, peak)
    shapes = [(b, h, r_), (b, h, p), (b, s, r_), (b, s, p)]
    args = [jax.random.normal(kk, sh, jnp.float32).astype(jnp.bfloat16) for kk, sh in zip(ks[3:7], shapes)]
    args.append(jax.vmap(lambda kk: jax.random.permutation(kk, s)[:k])(jax.random.split(ks[7], b)).astype(jnp.int32))
    f = jax.jit(lambda *o: pk.sparse_mla_decode(*o, softmax_scale=192 ** -0.5))
    ref = jax.jit(lambda *o: pk.sparse_mla_decode_reference(*o, softmax_scale=192 ** -0.5))
    compare("sparse_mla_decode", f, ref, args, a, 2 * b * k * (r_ + p), 2 * b * h * k * (2 * r_ + p), False, peak)


def bench_prefill(a, peak):
    b, t, h = a.prefill_batch, a.prefill_len, a.heads
    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = [jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
               for kk, d in zip(ks, (192, 192, 128))]
    f = jax.jit(lambda *o: pk.mla_prefill(*o, softmax_scale=192 ** -0.5))
    ref = jax.jit(lambda *o: pk.mla_prefill_reference(*o, softmax_scale=192 ** -0.5))
    flops = 2 * b * h * t * t * (192 + 128) // 2  # causal half
    bytes_ = 2 * b * t * h * (192 * 2 + 128 * 2)
    compare("mla_prefill fwd", f, ref, (q, k, v), a, bytes_, flops, False, peak)
    loss = lambda fn: jax.jit(jax.grad(lambda *o: jnp.sum(fn(*o).astype(jnp.float32)), (0, 1, 2)))
    compare("mla_prefill fwd+bwd", loss(f), loss(ref), (q, k, v), a, 3 * bytes_, 3.5 * flops, False, peak)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("iters", 2, "timed calls per kernel", flag_values=fv)
    flags.DEFINE_integer("m", 256, "fp8 matmul rows", flag_values=fv)
    flags.DEFINE_integer("n", 256, "fp8 matmul columns", flag_values=fv)
    flags.DEFINE_integer("k", 512, "fp8 matmul contraction", flag_values=fv)
    flags.DEFINE_integer("groups", 4, "grouped matmul groups", flag_values=fv)
    flags.DEFINE_integer("batch", 1, "decode batch", flag_values=fv)
    flags.DEFINE_integer("prefill_batch", 1, "prefill batch", flag_values=fv)
    flags.DEFINE_integer("heads", 16, "attention heads", flag_values=fv)
    flags.DEFINE_integer("decode_len", 1024, "decode cache length", flag_values=fv)
    flags.DEFINE_integer("prefill_len", 256, "prefill prompt length", flag_values=fv)
    flags.DEFINE_integer("topk", 2048, "entries the sparse decode attends to (DSA's index_topk)", flag_values=fv)
    flags.DEFINE_string("only", "fp8,grouped,decode,sparse,prefill", "kernels to run, comma-separated",
                        flag_values=fv)


def main(argv=None) -> int:
    a = cli.parse(define_flags, argv, __doc__)
    kind, peak = device_peak()
    be = pk.resolve_backend()
    print(f"device: {kind} ({jax.default_backend()}); kernel style {be.style}, "
          f"interpret={be.interpret}; peak table: {peak or 'n/a'}")
    benches = dict(fp8=bench_fp8, grouped=bench_grouped, decode=bench_decode, sparse=bench_sparse,
                   prefill=bench_prefill)
    for name in a.only.split(","):
        benches[name](a, peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())

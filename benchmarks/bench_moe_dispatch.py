"""Dispatch cost follows activated experts, not total: MoE forward time at 8 vs 64 experts.

Same tokens, same top-k, same expert size; only the number of experts changes. Each impl is timed
side by side in one run (the machine is shared and noisy), median of several repeats:

    python -m benchmarks.bench_moe_dispatch [--tokens 4096 --top_k 2 --dim 256 --hidden 128]

With --grad the forward and backward (of sum(y^2)) are timed, as a train step runs them; with
--headroom=H1,H2,... the `padded` groups are timed at each C / mean rows per expert
(dsv3_jax/ops/padded_groups.py HEADROOM), e.g. the e32_top4 bench variant's MoE layer:

    python -m benchmarks.bench_moe_dispatch --tokens 2048 --top_k 4 --dim 320 --hidden 128 --experts 32,64 \
        --impls padded,tiled --grad --headroom 1.0,1.25

Each impl is `dispatch.routed_experts(..., impl=...)`: the one expert-compute interface forced to
one path (`auto` is the platform's choice).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from dsv3_jax import cli
from dsv3_jax.ops import dispatch, padded_groups


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("tokens", 4096, "tokens routed", flag_values=fv)
    flags.DEFINE_integer("top_k", 2, "experts per token", flag_values=fv)
    flags.DEFINE_integer("dim", 256, "model dimension D", flag_values=fv)
    flags.DEFINE_integer("hidden", 128, "expert hidden size F", flag_values=fv)
    flags.DEFINE_list("experts", "8,64", "the two expert counts compared, LOW,HIGH", flag_values=fv)
    flags.DEFINE_list("impls", "padded,tiled,ragged,dense", "dispatch impls timed, comma-separated", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "timed runs (median)", flag_values=fv)
    flags.DEFINE_boolean("grad", False, "time forward + backward", flag_values=fv)
    flags.DEFINE_list("headroom", str(padded_groups.HEADROOM), "padded: C over the mean rows per expert, one timing "
                      "each, comma-separated", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.numbers(args, "experts")
    cli.numbers(args, "headroom", float)
    if len(args.experts) != 2:
        cli.usage(f"--experts={','.join(map(str, args.experts))}: expected two counts, LOW,HIGH")
    print(f"backend={jax.default_backend()} tokens={args.tokens} top_k={args.top_k} D={args.dim} F={args.hidden}")
    rows = {}
    for e in args.experts:
        ks = jax.random.split(jax.random.key(e), 5)
        x = jax.random.normal(ks[0], (args.tokens, args.dim), jnp.float32)
        experts = jnp.argsort(jax.random.uniform(ks[1], (args.tokens, e)), axis=1)[:, : args.top_k].astype(jnp.int32)
        weights = jnp.full((args.tokens, args.top_k), 1.0 / args.top_k)
        w1 = jax.random.normal(ks[2], (e, args.dim, args.hidden)) * 0.05
        w3 = jax.random.normal(ks[3], (e, args.dim, args.hidden)) * 0.05
        w2 = jax.random.normal(ks[4], (e, args.hidden, args.dim)) * 0.05
        for name, impl, headroom in _cases(args):
            padded_groups.HEADROOM = headroom  # read when the function is traced, by the first call
            rows[(name, e)] = _time(_fn(impl, args.grad, experts, weights), x, w1, w3, w2, repeats=args.repeats)
    lo, hi = args.experts
    print(f"{'impl':14s} {f'{lo} experts':>12s} {f'{hi} experts':>12s} {'ratio':>7s}")
    for name, _, _ in _cases(args):
        a, b = rows[(name, lo)], rows[(name, hi)]
        print(f"{name:14s} {a * 1e3:10.1f}ms {b * 1e3:10.1f}ms {b / a:7.2f}")
    return 0


def _cases(args) -> list[tuple[str, str, float]]:
    """(row name, impl, padded groups' headroom) of each timing."""
    out = []
    for impl in args.impls:
        heads = args.headroom if impl == "padded" else [padded_groups.HEADROOM]
        out += [(f"{impl} {h:g}" if impl == "padded" else impl, impl, h) for h in heads]
    return out


def _fn(impl: str, grad: bool, experts, weights):
    def forward(x, w1, w3, w2):
        return dispatch.routed_experts(x, experts, weights, w1, w3, w2, impl=impl)

    if not grad:
        return jax.jit(forward)
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(forward(*a) ** 2), argnums=(0, 1, 2, 3)))


if __name__ == "__main__":
    sys.exit(main())

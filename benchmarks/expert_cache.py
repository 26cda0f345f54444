"""Offloaded experts: hit rate and bytes moved per token against the cache size C, LRU vs LFU, with
and without the prefetch, on a trained model's routing.

    python -m benchmarks.expert_cache --checkpoint=runs/tiny [--prompts=4] [--prompt_len=32] \
        [--new_tokens=48] [--sizes=4,8,12]

The run's held-out rows give --prompts prompts of --prompt_len tokens, generated greedily one
after another (--new_tokens each, one row, MTP off) through `dsv3_jax/inference/expert_cache.py`
with the cache kept across prompts, as a server would keep it across requests. Figures are over
the decode steps only (each prompt's prefill is one chunk, whose experts are counted apart): hit
rate = 1 - on-demand loads / (layer, expert) lookups, bytes moved per generated token (misses and
prefetches), passes per decode step (1 + reruns after a miss). Every output is checked equal to
the model with every expert resident.
"""

from __future__ import annotations

import numpy as np
from absl import flags

from dsv3_jax import cli, load_pretrained
from dsv3_jax.inference import Generation, generate
from dsv3_jax.inference.expert_cache import ExpertOffload
from research.quant_quality import heldout_batches, whole_rows


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("checkpoint", None, "training run folder (its held-out split gives the prompts)",
                        required=True, flag_values=fv)
    flags.DEFINE_integer("prompts", 4, "prompts, generated one after another", flag_values=fv)
    flags.DEFINE_integer("prompt_len", 32, "tokens per prompt", flag_values=fv)
    flags.DEFINE_integer("new_tokens", 48, "tokens generated per prompt", flag_values=fv)
    flags.DEFINE_list("sizes", None, "cache sizes C (default: top_k, E/4, E/2, 3E/4)", flag_values=fv)


def measure(checkpoint: str, prompts_PxT: np.ndarray, new_tokens: int, size: int, policy: str, prefetch: bool,
            reference: list[np.ndarray]) -> dict:
    model = load_pretrained(checkpoint)
    offload = ExpertOffload(model, size, policy=policy, prefetch=prefetch)
    st, decode = offload.stats, dict(lookups=0, misses=0, bytes=0, passes=0, steps=0, tokens=0)
    for prompt, expected in zip(prompts_PxT, reference):
        gen = Generation(model, prompt[None], new_tokens, offload=offload, prefill_chunk=prompts_PxT.shape[1])
        for i, _ in enumerate(gen):
            if i == 0:  # the prefill is done: count the decode steps from here
                before = (st.lookups, st.misses, st.bytes_moved, st.passes, st.steps)
        after = (st.lookups, st.misses, st.bytes_moved, st.passes, st.steps)
        for key, b, a in zip(("lookups", "misses", "bytes", "passes", "steps"), before, after):
            decode[key] += a - b
        decode["tokens"] += gen.stats.generated_tokens - 1
        if not np.array_equal(gen.output()[0], expected):
            raise SystemExit(f"C={size} {policy}: the offloaded model's tokens differ from the resident model's")
    return decode


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    try:
        model = load_pretrained(args.checkpoint)
        cfg = model.config
        e, k = cfg.num_routed_experts, cfg.num_experts_per_token
        if args.sizes:
            cli.numbers(args, "sizes")
        else:
            args.sizes = sorted({k, e // 4, e // 2, 3 * e // 4})
        rows = whole_rows(heldout_batches(args.checkpoint, cfg.vocab_size, 8))[:args.prompts, :args.prompt_len]
        reference = [np.asarray(generate(model, p[None], args.new_tokens))[0] for p in rows]
        expert_mb = ExpertOffload(load_pretrained(args.checkpoint), k).expert_bytes / 1e6
        print(f"{args.checkpoint}: E = {e}, top_k = {k}, {cfg.num_moe_layers} MoE layers, {expert_mb:.3f} MB per "
              f"expert; {len(rows)} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens each\n")
        print("| C | policy | prefetch | hit rate | MB moved / token | experts moved / token | passes / step |")
        print("|---|---|---|---|---|---|---|")
        for size in args.sizes:
            for policy, prefetch in (("lru", False), ("lfu", False), ("lru", True), ("lfu", True)):
                d = measure(args.checkpoint, rows, args.new_tokens, size, policy, prefetch, reference)
                moved = d["bytes"] / d["tokens"]
                print(f"| {size} | {policy} | {'yes' if prefetch else 'no'} | {1 - d['misses'] / d['lookups']:.3f} | "
                      f"{moved / 1e6:.3f} | {moved / 1e6 / expert_mb:.2f} | {d['passes'] / d['steps']:.2f} |",
                      flush=True)
    except (ValueError, OSError) as e:
        return cli.fail(e)
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

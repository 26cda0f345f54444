"""Generates text from a checkpoint, streaming tokens as they are decoded.

    python -m experiments.generate --checkpoint=RUN_OR_CKPT_OR_HF_DIR [--tokenizer=tokenizer.json] \
        --prompt="Once upon a time" [--prompt=...] [--max_new_tokens=64] [--temperature=0.7] \
        [--top_k=50] [--top_p=0.95] [--seed=0] [--use_mtp] [--cache_dtype=bfloat16] [--prefill_chunk=512] [--stats] \
        [--page_size=16] \
        [--mesh=fsdp=2,expert=4 [--rules=default]] [--weights=fp8|int8|int4 [--quantize=experts|all] [--quant_group=128]] \
        [--expert_placement=FILE] [--redundant_experts=N] [--record_expert_load=load.json] \
        [--offload_experts --expert_cache=C [--expert_cache_policy=lru|lfu]]

--checkpoint takes a training run's folder (its latest step, e.g. runs/tiny), one of its steps
(runs/tiny/checkpoints/200), our Orbax checkpoint or an HF folder. The tokenizer is --tokenizer, else
the checkpoint folder's tokenizer.json, else a run's own, else the bundled BPE. A checkpoint folder's
generation_config.json (an HF export, or the source a converted checkpoint came from) adds its
eos_token_id(s) to the stop tokens and gives the defaults of the sampling flags it sets. Expected
errors (bad path, prompt ids outside the vocabulary) print one line, exit code 2.
With --mesh the weights are loaded straight onto the device mesh, each parameter built from the
shards its devices hold (load_pretrained(mesh=...), sharding/rules.py), never whole on the host;
the cache's rows are split as a batch (data x fsdp x expert) and the steps run under the mesh (jax.set_mesh), the MoE
layers expert-parallel. Expert parallelism splits the rows over data x fsdp x expert, so a batch of
prompts that those devices do not divide is padded with copies of its last prompt, decoded and dropped.
--weights holds the projections quantized as they load (load_pretrained(weights=...)): FP8 with
its 128x128 blocks as stored (or quantized so), or int8/int4 with a scale per --quant_group rows;
--quantize says which (default: every projection for fp8, the routed experts for int8/int4).
--offload_experts loads the routed experts straight into host memory (load_pretrained(
offload_experts=True): never onto the accelerator) and keeps C of them per MoE layer on the
device (dsv3_jax/inference/expert_cache.py: same tokens as with every expert resident); it prints
the cache's hit rate, bytes moved per token and stall time.

One prompt streams its continuation as it is produced; several are decoded as one ragged batch and
printed at the end. Prints prefill time and decode tokens/s; `--stats` adds per-layer expert
activation frequencies over the prompt tokens (from the prefill's router statistics) and, with
`--use_mtp`, the draft acceptance rate and tokens per forward.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from absl import flags

import sharding
from sharding import eplb, multihost
from dsv3_jax import cli, load_pretrained
from dsv3_jax.checkpoint import run_folder
from dsv3_jax.checkpoint.hf_tokenizer import read_generation_config
from dsv3_jax.data import load_tokenizer
from dsv3_jax.inference import Generation
from dsv3_jax.inference.expert_cache import ExpertOffload
from dsv3_jax.inference.prefill import DEFAULT_CHUNK
from dsv3_jax.inference.cache import cache_sharding, token_shards


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("checkpoint", None, "training run folder or step folder, Orbax checkpoint, or HF folder "
                        "(config.json + safetensors)", required=True, flag_values=fv)
    flags.DEFINE_string("tokenizer", None, "tokenizer.json or a folder holding one (default: the run's, else the "
                        "bundled BPE)", flag_values=fv)
    flags.DEFINE_multi_string("prompt", None, "repeat for a batch", required=True, flag_values=fv)
    flags.DEFINE_integer("max_new_tokens", None, "default: generation_config.json's, else 64", flag_values=fv)
    flags.DEFINE_float("temperature", None, "0: greedy (default: generation_config.json's, else 0)", flag_values=fv)
    flags.DEFINE_integer("top_k", None, "sample among the k most likely tokens (default: generation_config.json's)",
                         flag_values=fv)
    flags.DEFINE_float("top_p", None, "nucleus sampling mass (default: generation_config.json's)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)
    flags.DEFINE_boolean("use_mtp", False, "MTP speculative decoding", flag_values=fv)
    flags.DEFINE_enum("cache_dtype", None, ["float32", "bfloat16", "float8", "int8"], "latent cache dtype",
                      flag_values=fv)
    flags.DEFINE_integer("prefill_chunk", DEFAULT_CHUNK, "prompt tokens per prefill step", flag_values=fv)
    flags.DEFINE_integer("page_size", None, "a paged latent cache of pages of this many tokens, each prompt holding "
                         "pages for its own tokens (default: one cache row per prompt)", flag_values=fv)
    flags.DEFINE_string("dtype", None, "parameter dtype to load in (default: the checkpoint's)", flag_values=fv)
    flags.DEFINE_boolean("no_bos", False, "do not prepend the tokenizer's BOS", flag_values=fv)
    flags.DEFINE_boolean("stats", False, "print expert activation frequencies of the prompts", flag_values=fv)
    cli.define_mesh_flags(fv, "device mesh to load onto")
    cli.define_weight_flags(fv)
    cli.define_expert_flags(fv, "prompt tokens")


def parse_args(argv=None):
    return cli.with_mesh(cli.parse(define_flags, argv, __doc__))


def encode_prompts(tokenizer, prompts: list[str], bos: bool) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int32 [B, T] ids and lengths [B]."""
    ids = [([tokenizer.bos_id] if bos else []) + tokenizer.encode(p) for p in prompts]
    if not all(ids):
        raise ValueError("every --prompt must encode to at least one token (or drop --no_bos)")
    lengths = np.array([len(i) for i in ids], np.int32)
    out = np.full((len(ids), lengths.max()), tokenizer.pad_id, np.int32)
    for row, i in enumerate(ids):
        out[row, :len(i)] = i
    return out, lengths


def pad_rows(prompts_BxT: np.ndarray, lengths_B: np.ndarray, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch padded to a multiple of `multiple` rows with copies of its last row."""
    extra = -len(prompts_BxT) % multiple
    return (np.concatenate([prompts_BxT, np.repeat(prompts_BxT[-1:], extra, 0)]),
            np.concatenate([lengths_B, np.repeat(lengths_B[-1:], extra)]))


def _on_mesh(steps, mesh):
    """Iterates `steps` with `mesh` as the context mesh (traced and run expert-parallel)."""
    if mesh is None:
        yield from steps
        return
    it = iter(steps)
    while True:
        with jax.set_mesh(mesh):
            step = next(it, None)
        if step is None:
            return
        yield step


def print_expert_frequencies(counts_LxE: np.ndarray, first_moe_layer: int, top_k: int, out=sys.stdout) -> None:
    """Fraction of the prompt tokens routed to each expert, one line per MoE layer (sums to top_k)."""
    print("expert activation frequency (share of prompt tokens routed to each expert):", file=out)
    tokens = counts_LxE.sum(-1, keepdims=True) / top_k
    freq = counts_LxE / np.maximum(tokens, 1)
    for layer, row in enumerate(freq):
        busiest = np.argsort(-row)[:4]
        top = ", ".join(f"e{e}={row[e]:.3f}" for e in busiest)
        print(f"  layer {first_moe_layer + layer:3d}: " + " ".join(f"{f:.3f}" for f in row) + f"  | top: {top}",
              file=out)


def _pick(flag, from_file, default):
    """The flag when given, else generation_config.json's value, else our default."""
    return flag if flag is not None else from_file if from_file is not None else default


def build(args):
    """(run folder or None, mesh or None, model, expert offload or None, tokenizer, Generation) for the flags."""
    cli.check_offload_flags(args)  # before the model loads
    run = run_folder.find(args.checkpoint)
    mesh = sharding.make_mesh(args.mesh) if args.mesh else None
    model = load_pretrained(args.checkpoint, dtype=args.dtype, mesh=mesh, rules=args.rules, weights=args.weights,
                            quantize=args.quantize, quant_group=args.quant_group,
                            expert_placement=args.expert_placement, redundant_experts=args.redundant_experts,
                            offload_experts=args.offload_experts)
    offload = ExpertOffload(model, args.expert_cache, policy=args.expert_cache_policy) if args.offload_experts else None
    own = os.path.join(args.checkpoint, "tokenizer.json")
    tokenizer = load_tokenizer(args.tokenizer or (own if os.path.isfile(own) else run.tokenizer if run else None))
    defaults = read_generation_config(args.checkpoint)
    prompts, lengths = pad_rows(*encode_prompts(tokenizer, args.prompt, bos=not args.no_bos), token_shards(mesh))
    stop = tuple(dict.fromkeys((tokenizer.eos_id, *defaults.eos_ids)))
    gen = Generation(model, prompts, _pick(args.max_new_tokens, defaults.max_new_tokens, 64),
                     temperature=_pick(args.temperature, defaults.temperature, 0.0),
                     top_k=_pick(args.top_k, defaults.top_k, None), top_p=_pick(args.top_p, defaults.top_p, None),
                     seed=args.seed, lengths=lengths, stop_tokens=stop,
                     use_mtp=args.use_mtp, pad_id=tokenizer.pad_id, cache_dtype=args.cache_dtype,
                     prefill_chunk=args.prefill_chunk, cache_sharding=cache_sharding(mesh, len(prompts), args.rules),
                     rows=len(args.prompt), offload=offload, page_size=args.page_size)
    return run, mesh, model, offload, tokenizer, gen


def print_generation(gen, mesh, tokenizer, prompts: list[str]) -> None:
    """One prompt: its continuation streamed as decoded; several: each printed whole at the end."""
    stream = len(prompts) == 1
    generated: list[list[int]] = [[] for _ in prompts]
    if stream:
        print(prompts[0], end="", flush=True)
    shown = ""
    for step in _on_mesh(gen, mesh):
        for row, n in enumerate(step.counts[:len(prompts)]):  # not the padding rows
            generated[row].extend(int(t) for t in step.tokens[row, :n])
        if stream:  # decode the whole continuation: byte-level pieces only become text together
            text = tokenizer.decode(generated[0], skip_special_tokens=True)
            print(text[len(shown):], end="", flush=True)
            shown = text
    if stream:
        print()
    else:
        for prompt, ids in zip(prompts, generated):
            print(f"--- {prompt!r}\n{prompt}{tokenizer.decode(ids, skip_special_tokens=True)}")


def print_stats(args, gen, model, offload) -> None:
    """Prefill and decode speed; MTP acceptance, the expert cache and expert frequencies when asked."""
    st = gen.stats
    print(f"prefill {st.prefill_seconds:.3f}s, first decode step {st.first_step_seconds:.3f}s (both compile) | "
          f"then {st.timed_tokens} tokens in {st.decode_seconds:.3f}s: {st.tokens_per_second:.1f} tokens/s")
    if args.use_mtp:
        print(f"MTP: acceptance rate {st.acceptance_rate:.3f}, {st.tokens_per_forward:.2f} tokens per forward")
    if offload is not None:
        ec = offload.stats
        print(f"expert cache ({args.expert_cache} of {model.config.num_routed_experts} per layer, "
              f"{args.expert_cache_policy}): hit rate {ec.hit_rate:.3f}, {ec.bytes_moved / st.generated_tokens / 1e6:.2f} "
              f"MB moved per token, {ec.passes / ec.steps:.2f} passes per step, stall {ec.stall_seconds:.3f}s")
    if args.stats and st.prompt_expert_counts is not None:
        print_expert_frequencies(st.prompt_expert_counts, model.config.num_dense_layers,
                                 model.config.num_experts_per_token)
    if args.record_expert_load and st.prompt_expert_counts is not None:
        eplb.write_load(args.record_expert_load, st.prompt_expert_counts, model.config.num_dense_layers)


def main(argv=None) -> int:
    args = parse_args(argv)
    multihost.initialize()
    try:
        run, mesh, model, offload, tokenizer, gen = build(args)
    except (ValueError, OSError) as e:
        return cli.fail(e)
    if run:
        print(f"[{run.run_dir} at step {run.step}]", file=sys.stderr)
    if note := cli.expert_slots_note(offload, "--prefill_chunk"):
        print(note, file=sys.stderr)
    print_generation(gen, mesh, tokenizer, args.prompt)
    print_stats(args, gen, model, offload)
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

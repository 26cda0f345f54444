"""An OpenAI-compatible server over the continuous-batching engine.

    python -m experiments.serve --checkpoint=RUN_OR_CKPT_OR_HF [--tokenizer=tokenizer.json] [--host=127.0.0.1] \
        [--port=8000] [--max_batch=16] [--max_seq_len=2048] [--chunk=64] [--noprefix_cache] [--use_mtp] \
        [--page_size=CHUNK] [--max_cache_tokens=N | --cache_memory_fraction=0.9] \
        [--max_queue=256] [--max_request_bytes=4194304] \
        [--cache_dtype=bfloat16] [--mesh=tensor=2,expert=4 [--rules=default]] \
        [--weights=fp8|int8|int4 [--quantize=experts|all] [--quant_group=128]] \
        [--expert_placement=FILE] [--redundant_experts=N] [--record_expert_load=load.json] \
        [--offload_experts --expert_cache=C [--expert_cache_policy=lru|lfu]]

Then point any OpenAI client at http://HOST:PORT/v1 (model name: --served_model_name, default the
checkpoint folder's name). The tokenizer is the checkpoint folder's tokenizer.json when it has one,
else --tokenizer, else a training run's own, else the bundled BPE. All compiles run before the port opens;
a compile after that (a shape warm-up missed: a stall of seconds) is logged as a warning. See docs/serving.md.

With --mesh the weights are loaded straight onto the device mesh, each parameter built from the shards
its devices hold (load_pretrained(mesh=...), the rules table sharding/rules.py: MLA heads on `tensor`,
routed experts on `expert`), the cache's slots and pages are split over `data` x `fsdp` x `expert`, and every
step runs under the mesh, the MoE layers expert-parallel (dsv3_jax/serving/runner.py). One process
drives all the mesh's devices (a multi-host server would need every process to run the same steps).
--weights, --quantize and --quant_group are experiments.generate's: the projections held quantized as
they load (load_pretrained(weights=...)), FP8 in 128x128 blocks or int8/int4 with a scale per
--quant_group rows; with --mesh each quantized leaf (values and scales) is built per shard.
--offload_experts loads the routed experts straight into host memory (never onto the accelerator)
and holds them there behind a device cache of --expert_cache
per MoE layer (one device; dsv3_jax/inference/expert_cache.py); /metrics then reports the cache's
hit rate, bytes moved per token and stall time (dsv3_expert_cache_*).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from absl import flags

import sharding
from sharding import eplb
from dsv3_jax import cli


def define_flags(fv: flags.FlagValues) -> None:
    from dsv3_jax.serving.server import MAX_REQUEST_BYTES  # here: main first says if the serve extra is missing

    flags.DEFINE_string("checkpoint", None, "training run or step folder, Orbax checkpoint, or HF folder "
                        "(config.json + safetensors)", required=True, flag_values=fv)
    flags.DEFINE_string("tokenizer", None, "tokenizer.json (or its folder) when the checkpoint folder has none "
                        "(default: the run's, else the bundled BPE)", flag_values=fv)
    flags.DEFINE_string("host", "127.0.0.1", "address to listen on", flag_values=fv)
    flags.DEFINE_integer("port", 8000, "port to listen on", flag_values=fv)
    flags.DEFINE_integer("max_batch", 16, "decode slots (concurrent requests)", flag_values=fv)
    flags.DEFINE_integer("max_seq_len", 2048, "context per slot: prompt + max_tokens", flag_values=fv)
    flags.DEFINE_integer("chunk", 64, "prefill chunk length (a power of two)", flag_values=fv)
    flags.DEFINE_integer("page_size", None, "tokens per page of the latent cache: requests hold pages for what they "
                         "have, the newest preempted when they run out (default: --chunk, so prompts share "
                         "prefixes in whole chunks)", flag_values=fv)
    flags.DEFINE_integer("max_cache_tokens", None, "tokens the page pool holds, all requests "
                         "together (default: what fits --cache_memory_fraction of the device's memory after the "
                         "weights; where the device reports no memory, as on CPU, max_batch x max_seq_len)",
                         flag_values=fv)
    flags.DEFINE_float("cache_memory_fraction", 0.9, "the share of the device's memory the weights "
                       "and the page pool may fill, when --max_cache_tokens is not given", flag_values=fv)
    flags.DEFINE_integer("max_queue", 256, "waiting requests beyond which the server answers 429", flag_values=fv)
    flags.DEFINE_integer("max_request_bytes", MAX_REQUEST_BYTES, "largest request body accepted; a bigger one is "
                         "refused (413) before it is read", flag_values=fv)
    flags.DEFINE_boolean("prefix_cache", True, "prompts share the pages of their common prefixes (in granules of "
                         "lcm(--page_size, --chunk) tokens, kept while the pool has room, evicted least recently "
                         "used); off with --use_mtp", flag_values=fv)
    flags.DEFINE_boolean("use_mtp", False, "MTP speculative decoding (drafts verified in one step)", flag_values=fv)
    flags.DEFINE_enum("cache_dtype", None, ["float32", "bfloat16", "float8", "int8"], "latent cache dtype",
                      flag_values=fv)
    flags.DEFINE_string("dtype", None, "parameter dtype to load in (default: the checkpoint's)", flag_values=fv)
    flags.DEFINE_string("served_model_name", None, "model id clients send (default: checkpoint folder name)",
                        flag_values=fv)
    cli.define_mesh_flags(fv, "device mesh to serve on")
    cli.define_weight_flags(fv)
    cli.define_expert_flags(fv, "decoded tokens (written at shutdown)")


def parse_args(argv=None):
    args = cli.with_mesh(cli.parse(define_flags, argv, __doc__))
    if args.page_size is None:  # a page per prefill chunk: a shared prefix's granule is one chunk
        args.page_size = args.chunk
    return args


def build(args):
    """-> (FastAPI app, engine), the engine started and every step compiled."""
    import jax

    from dsv3_jax import load_pretrained
    from dsv3_jax.checkpoint import run_folder
    from dsv3_jax.checkpoint.hf_tokenizer import read_generation_config
    from dsv3_jax.model import quant as model_quant
    from dsv3_jax.inference.expert_cache import ExpertOffload
    from dsv3_jax.serving import ChatTokenizer, Engine, Runner, make_app, tokenizer_file

    cli.check_offload_flags(args)  # before the model loads
    run = run_folder.find(args.checkpoint)  # a training run or one of its steps: the run's tokenizer
    mesh = sharding.make_mesh(args.mesh) if args.mesh else None
    model = load_pretrained(args.checkpoint, dtype=args.dtype, mesh=mesh, rules=args.rules, weights=args.weights,
                            quantize=args.quantize, quant_group=args.quant_group,
                            expert_placement=args.expert_placement, redundant_experts=args.redundant_experts,
                            offload_experts=args.offload_experts)
    if args.weights:
        logging.info("projections held as %s (%s): %.1f MB of parameter arrays", args.weights,
                     args.quantize or model_quant.default_targets(args.weights), model_quant.parameter_bytes(model) / 1e6)
    chat = ChatTokenizer(tokenizer_file(args.checkpoint, args.tokenizer or (run.tokenizer if run else None)))
    if chat.tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer {chat.path} has {chat.tokenizer.vocab_size} ids, more than the model's "
                         f"vocab_size {model.config.vocab_size}: pass the checkpoint's own --tokenizer")
    max_seq_len = min(args.max_seq_len, model.config.max_position_embeddings)
    cache_tokens, source = pool_tokens(args, model.config, max_seq_len, mesh)
    runner = Runner(model, max_batch=args.max_batch, max_seq_len=max_seq_len, cache_dtype=args.cache_dtype,
                    chunk=args.chunk, use_mtp=args.use_mtp, mesh=mesh, rules=args.rules, page_size=args.page_size,
                    cache_tokens=cache_tokens,
                    offload=ExpertOffload(model, args.expert_cache, policy=args.expert_cache_policy)
                    if args.offload_experts else None)
    logging.info("paged cache: %d tokens in %d pages of %d, %.4g GB (%s)", runner.cache_tokens,
                 runner.cache_tokens // args.page_size, args.page_size,
                 sum(a.nbytes for a in jax.tree.leaves(runner.cache)) / 1e9, source)
    if note := cli.expert_slots_note(runner.offload, "--chunk"):
        logging.info(note)
    start = time.perf_counter()
    runner.warm_up()
    logging.info("warm-up compiled every shape a request can meet in %.1fs: prefill chunks of %s tokens, decode "
                 "buckets of %s rows%s", time.perf_counter() - start, runner.chunk, runner.decode_buckets,
                 f", on the mesh {dict(mesh.shape)}" if mesh is not None else "")
    _warn_on_compiles()
    prefix = args.prefix_cache and not args.use_mtp  # not with MTP: see serving/engine.py
    if prefix != args.prefix_cache:
        logging.info("prefix caching is off with --use_mtp")
    eos_ids = read_generation_config(args.checkpoint).eos_ids  # generation_config.json's, if the folder has one
    engine = Engine(runner, chat.tokenizer, max_queue=args.max_queue, prefix_cache=prefix, eos_ids=eos_ids)
    engine.start()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.checkpoint))
    return make_app(engine, chat, name, args.max_request_bytes), engine


def pool_tokens(args, cfg, max_seq_len: int, mesh=None) -> tuple[int, str]:
    """-> (tokens of the page pool, where the figure comes from): --max_cache_tokens, else what fits
    one device's memory after the weights (a device holds its batch shard's pages, so the pool is
    that times the shards), else (no memory reported: CPU) a page-rounded max_seq_len per slot.
    Both defaults are whole pages that the mesh's batch shards divide."""
    import jax

    from dsv3_jax.inference import cache_bytes_per_token
    from dsv3_jax.inference.cache import token_shards
    from dsv3_jax.inference.page_pool import fitting_tokens

    if args.page_size < 1:
        raise ValueError(f"--page_size must be >= 1 token, got {args.page_size}")
    if args.max_cache_tokens is not None:
        return args.max_cache_tokens, "--max_cache_tokens"
    layers = cfg.num_layers + (cfg.num_mtp_layers if args.use_mtp else 0)
    token_bytes = cache_bytes_per_token(cfg, args.cache_dtype or cfg.compute_dtype) * layers
    fits = fitting_tokens(jax.devices()[0].memory_stats(), token_bytes, args.cache_memory_fraction)
    if fits is None:
        pages = args.max_batch * -(-max_seq_len // args.page_size)
        return pages * args.page_size, "max_batch x max_seq_len in whole pages: the device reports no memory"
    shards = token_shards(mesh) if mesh is not None else 1
    return fits // args.page_size * shards * args.page_size, (
        f"{args.cache_memory_fraction:.0%} of each device's memory less what the weights hold, x {shards} batch shards")


def _warn_on_compiles() -> None:
    """From now on, every backend compile is logged as a warning: warm-up should have made them all."""
    import jax

    def listener(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            logging.warning("compiled after warm-up (%.2fs): a shape the warm-up missed", seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)


def main(argv=None) -> int:
    try:
        import dsv3_jax.serving  # noqa: F401
    except ModuleNotFoundError as e:  # no serve extra: the message names it
        return cli.fail(e)
    args = parse_args(argv)
    # force: an imported library may have put a handler on the root logger already
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", force=True)
    try:
        app, engine = build(args)
    except (ValueError, OSError) as e:  # MeshError is one
        return cli.fail(e)
    import uvicorn

    # uvicorn re-raises the signal that stopped it: SIGTERM then leaves through `finally`, as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
        if args.record_expert_load and engine.metrics.expert_counts is not None:
            eplb.write_load(args.record_expert_load, engine.metrics.expert_counts,
                            engine.runner.config.num_dense_layers)
            logging.info("expert load of %d decode steps written to %s", engine.metrics.decode_steps,
                         args.record_expert_load)
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

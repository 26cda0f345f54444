"""An OpenAI-compatible server over the continuous-batching engine.

    python -m experiments.serve --checkpoint=RUN_OR_CKPT_OR_HF [--tokenizer=tokenizer.json] [--host=127.0.0.1] \
        [--port=8000] [--max_batch=16] [--max_seq_len=2048] [--chunk=64] [--prefix_cache_blocks=64] [--use_mtp] \
        [--max_queue=256] [--max_request_bytes=4194304] \
        [--cache_dtype=bfloat16] [--mesh=tensor=2,expert=4 [--rules=default]] \
        [--weights=fp8|int8|int4 [--quantize=experts|all] [--quant_group=128]]

Then point any OpenAI client at http://HOST:PORT/v1 (model name: --served_model_name, default the
checkpoint folder's name). The tokenizer is the checkpoint folder's tokenizer.json when it has one,
else --tokenizer, else a training run's own, else the bundled BPE. All compiles run before the port opens;
a compile after that (a shape warm-up missed: a stall of seconds) is logged as a warning. See docs/serving.md.

With --mesh the weights are loaded straight onto the device mesh, each parameter built from the shards
its devices hold (load_pretrained(mesh=...), the rules table sharding/rules.py: MLA heads on `tensor`,
routed experts on `expert`), the cache's slots are split over `data` x `fsdp` x `expert`, and every
step runs under the mesh, the MoE layers expert-parallel (dsv3_jax/serving/runner.py). One process
drives all the mesh's devices (a multi-host server would need every process to run the same steps).
--weights, --quantize and --quant_group are experiments.generate's: the projections held quantized as
they load (load_pretrained(weights=...)), FP8 in 128x128 blocks or int8/int4 with a scale per
--quant_group rows; with --mesh each quantized leaf (values and scales) is built per shard.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import sharding
from experiments.generate import add_weight_flags, mesh_sizes


def parse_args(argv=None) -> argparse.Namespace:
    from dsv3_jax.serving.server import MAX_REQUEST_BYTES  # here: main first says if the serve extra is missing

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="training run or step folder, Orbax checkpoint, or HF folder (config.json + safetensors)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or its folder) when the checkpoint folder has none (default: the run's, "
                        "else the bundled BPE)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_batch", type=int, default=16, help="decode slots (concurrent requests)")
    p.add_argument("--max_seq_len", type=int, default=2048, help="context per slot: prompt + max_tokens")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk length (a power of two)")
    p.add_argument("--max_queue", type=int, default=256, help="waiting requests beyond which the server answers 429")
    p.add_argument("--max_request_bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="largest request body accepted; a bigger one is refused (413) before it is read")
    p.add_argument("--prefix_cache_blocks", type=int, default=64,
                   help="prompt-prefix blocks (--chunk positions of cache rows each) kept for reuse, LRU; 0 = off")
    p.add_argument("--use_mtp", action="store_true", help="MTP speculative decoding (drafts verified in one step)")
    p.add_argument("--cache_dtype", default=None, choices=["float32", "bfloat16", "float8", "int8"])
    p.add_argument("--dtype", default=None, help="parameter dtype to load in (default: the checkpoint's)")
    p.add_argument("--served_model_name", default=None, help="model id clients send (default: checkpoint folder name)")
    p.add_argument("--mesh", default=None, type=mesh_sizes,
                   help="device mesh to serve on, e.g. tensor=2,expert=4 (axes: " + ", ".join(sharding.AXES) + ")")
    p.add_argument("--rules", default="default", help="sharding/rules.py preset for --mesh")
    add_weight_flags(p)
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    """-> (FastAPI app, engine), the engine started and every step compiled."""
    from dsv3_jax import load_pretrained
    from dsv3_jax.checkpoint import run_folder
    from dsv3_jax.checkpoint.hf_tokenizer import read_generation_config
    from dsv3_jax.model import quant as model_quant
    from dsv3_jax.serving import ChatTokenizer, Engine, Runner, make_app, tokenizer_file

    run = run_folder.find(args.checkpoint)  # a training run or one of its steps: the run's tokenizer
    mesh = sharding.make_mesh(args.mesh) if args.mesh else None
    model = load_pretrained(args.checkpoint, dtype=args.dtype, mesh=mesh, rules=args.rules, weights=args.weights,
                            quantize=args.quantize, quant_group=args.quant_group)
    if args.weights:
        logging.info("projections held as %s (%s): %.1f MB of parameter arrays", args.weights,
                     args.quantize or model_quant.default_targets(args.weights), model_quant.parameter_bytes(model) / 1e6)
    chat = ChatTokenizer(tokenizer_file(args.checkpoint, args.tokenizer or (run.tokenizer if run else None)))
    if chat.tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer {chat.path} has {chat.tokenizer.vocab_size} ids, more than the model's "
                         f"vocab_size {model.config.vocab_size}: pass the checkpoint's own --tokenizer")
    max_seq_len = min(args.max_seq_len, model.config.max_position_embeddings)
    runner = Runner(model, max_batch=args.max_batch, max_seq_len=max_seq_len, cache_dtype=args.cache_dtype,
                    chunk=args.chunk, use_mtp=args.use_mtp, mesh=mesh, rules=args.rules)
    start = time.perf_counter()
    runner.warm_up()
    logging.info("warm-up compiled every shape a request can meet in %.1fs: prefill chunks of %s tokens, decode "
                 "buckets of %s rows%s", time.perf_counter() - start, runner.chunk, runner.decode_buckets,
                 f", on the mesh {dict(mesh.shape)}" if mesh is not None else "")
    _warn_on_compiles()
    prefix = 0 if args.use_mtp else args.prefix_cache_blocks  # not with MTP: see serving/engine.py
    if args.use_mtp and args.prefix_cache_blocks:
        logging.info("prefix caching is off with --use_mtp")
    eos_ids = read_generation_config(args.checkpoint).eos_ids  # generation_config.json's, if the folder has one
    engine = Engine(runner, chat.tokenizer, max_queue=args.max_queue, prefix_cache=prefix, eos_ids=eos_ids)
    engine.start()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.checkpoint))
    return make_app(engine, chat, name, args.max_request_bytes), engine


def _warn_on_compiles() -> None:
    """From now on, every backend compile is logged as a warning: warm-up should have made them all."""
    import jax

    def listener(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            logging.warning("compiled after warm-up (%.2fs): a shape the warm-up missed", seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)


def main(argv=None) -> int:
    from dsv3_jax import cli

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

    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

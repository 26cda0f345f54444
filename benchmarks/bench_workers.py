"""The workers of `benchmarks.bench`: each measure's workload in dsv3-jax and in HF transformers.

Run one at a time in fresh processes by the driver (benchmarks/bench.py), which loads this file by
path, so that a --baseline tree's dsv3_jax is measured with today's workloads. Config of both
frameworks in BENCH_CONFIG; `small` from experiments/configs/small.py.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

BENCH_CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                    num_layers=4, num_dense_layers=1, num_heads=4, q_lora_rank=128, kv_lora_rank=64,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_routed_experts=16,
                    num_shared_experts=1, num_experts_per_token=2, num_expert_groups=4, num_groups_per_token=2,
                    num_mtp_layers=0, yarn=None, max_position_embeddings=8192, param_dtype="float32",
                    compute_dtype="float32", initializer_range=0.02)


# The sweep's grid (`python -m benchmarks.bench --only=sweep`): each variant is BENCH_CONFIG with
# these fields changed, so that no single tuned shape carries the figures. "tiny" is for the bench's
# CLI test only.
VARIANTS = {
    "bench": {},  # BENCH_CONFIG itself: D 256, 4 heads, top-2 of 16 in 4 groups keeping 2, V 4096
    # D 320, 5 heads, 5 layers, top-4 of 32 experts in 8 groups keeping 4, V 8192
    "e32_top4": dict(vocab_size=8192, hidden_size=320, num_heads=5, num_layers=5, num_routed_experts=32,
                     num_experts_per_token=4, num_expert_groups=8, num_groups_per_token=4),
    "odd": dict(vocab_size=6000, hidden_size=192, num_heads=3, num_routed_experts=24, num_experts_per_token=3,
                num_expert_groups=1, num_groups_per_token=1),  # no group limit, top-3, a vocab of no power of 2
    "wide": dict(vocab_size=12000, hidden_size=448, num_heads=7, num_routed_experts=16, num_experts_per_token=6,
                 num_expert_groups=4, num_groups_per_token=3),  # D = 3.5 x 128, top-6, 3 of 4 groups
    # qk and v head dims of 16 (the bench's 32 / 16 / 32 halved where it can be): small heads make
    # the prefill's per-head work (expanding the cached prefix, the attention's dots) thin matmuls.
    "small_heads": dict(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
    "tiny": dict(vocab_size=512, hidden_size=72, intermediate_size=96, moe_intermediate_size=24, num_layers=2,
                 num_heads=3, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, num_routed_experts=8, num_experts_per_token=3, num_expert_groups=2,
                 num_groups_per_token=1, max_position_embeddings=1024),
}
GRID = ("bench", "e32_top4", "odd", "wide", "small_heads")  # the sweep's default variants


def model_config(name: str, experts: int | None = None):
    from dsv3_jax import ModelConfig

    if name == "issue" or name in VARIANTS:
        fields = dict(BENCH_CONFIG, **VARIANTS.get(name, {}))
        if experts:
            fields["num_routed_experts"] = experts
        return ModelConfig(**fields)
    from experiments.configs import small

    return ModelConfig.from_dict(dict(small.get_config().model.to_dict(), compute_dtype="float32", num_mtp_layers=0))


# ----------------------------------------------------------------------------------- workers
def _timed_steps(run_step, steps: int, cpu: list | None = None) -> tuple[float, list[float]]:
    """Seconds of the first call and of each of `steps` more; `cpu` (a list) gets each timed call's
    CPU seconds (user + system, all threads of the process)."""
    start = time.perf_counter()
    run_step()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start, used = time.perf_counter(), _cpu_s()
        run_step()
        times.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append(_cpu_s() - used)
    return first, times


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def jax_train_parts(name, experts, batch, seq, donate: bool = True):
    """`train_parts` of a bench config with the base config's optimizer, as the trainer runs it."""
    from experiments.configs.base import base_config

    cfg = model_config(name, experts)
    try:  # the CPU tuning the trainer applies (a --baseline tree from before dsv3_jax/host.py did it in the model)
        from dsv3_jax import host

        cfg = host.tune_model(cfg)
    except ImportError:
        pass
    return train_parts(cfg, base_config().optimizer, batch, seq, donate)


def train_parts(cfg, opt, batch, seq, donate: bool = True):
    """(jitted train step, initial train state, a fixed random batch [batch, seq + 1]) of a
    ModelConfig with the optimizer section `opt` (its schedule over 1000 steps). The step donates
    its state as `python -m experiments.train` runs it (`donate`: False for a caller that calls the
    step again on the same state)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv3_jax import DeepSeekV3
    from dsv3_jax.train import optimizer as optimizer_lib, state as state_lib, step as step_lib

    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    _, params, _ = state_lib.split_model(model)
    tx = optimizer_lib.make_optimizer(opt, 1000, optimizer_lib.decay_mask(params))
    graphdef, state = state_lib.init_train_state(model, tx, 0)
    train_step = step_lib.make_train_step(graphdef, tx, optimizer_lib.make_schedule(opt, 1000), mtp_weight=0.3,
                                          balance_weight=1e-4, bias_update_speed=1e-3, donate=donate)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size, jnp.int32)
    data = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens),
            "positions": jnp.broadcast_to(jnp.arange(seq + 1, dtype=jnp.int32), tokens.shape)}
    return train_step, state, data


def jax_train_workload(name, experts, batch, seq):
    """A callable running one train step (fwd + bwd + clipped AdamW) on a fixed random batch."""
    import jax

    train_step, state, data = jax_train_parts(name, experts, batch, seq)
    holder = [state]

    def run_step():
        holder[0], metrics = train_step(holder[0], data)
        jax.block_until_ready(metrics["loss"])

    return run_step


def jax_train(name, experts, batch, seq, steps):
    cpu = []
    first, times = _timed_steps(jax_train_workload(name, experts, batch, seq), steps, cpu)
    return {"first_step_s": first, "step_s": times, "cpu_step_s": cpu, "peak": jax_peak()}


def hf_model(cfg):
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg.to_hf_config())).float()


def hf_train(name, experts, batch, seq, steps):
    import torch

    cfg = model_config(name, experts)
    model = hf_model(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def run_step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    cpu = []
    first, times = _timed_steps(run_step, steps, cpu)
    return {"first_step_s": first, "step_s": times, "cpu_step_s": cpu, "peak": torch_peak()}


def jax_decode_workload(prompt, batch, new_tokens, name: str = "issue", page_size: int = 0):
    """A callable: greedy `generate` of `new_tokens` (default) after random prompts (through a paged
    cache of `page_size`-token pages; 0: the contiguous cache); returns seconds."""
    import jax
    from flax import nnx

    from dsv3_jax import DeepSeekV3
    from dsv3_jax.inference import generate

    cfg = model_config(name)
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, prompt)).astype(np.int32)

    paged = dict(page_size=page_size) if page_size else {}

    def run(n=new_tokens):
        start = time.perf_counter()
        jax.block_until_ready(generate(model, prompts, n, **paged))
        return time.perf_counter() - start

    return run


def jax_decode(prompt, batch, new_tokens, repeats: int = 3, name: str = "issue"):
    """Greedy decode: seconds from the first generated token (the prefill's) to the last, per run."""
    from flax import nnx

    from dsv3_jax import DeepSeekV3
    from dsv3_jax.inference.generate import Generation

    cfg = model_config(name)
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, prompt)).astype(np.int32)

    def run():
        stamps = [time.perf_counter() for _ in Generation(model, prompts, new_tokens)]
        return stamps[-1] - stamps[0]  # the first step yields the prefill's token

    start = time.perf_counter()
    run()
    return {"compile_s": time.perf_counter() - start, "decode_s": [run() for _ in range(repeats)]}


# transformers' prefill before a timed decode, in chunks of this many tokens (`prefill_chunk_size`).
# Whole, a 4K x 8 prompt's SDPA held [B, H, 4096, 4096] fp32 scores: 5.4 GB peak RSS on the bench
# variant (more with 7 heads), which the kernel's OOM killer took on the shared 24 GB machine;
# chunked, 1.3 GB. The decode is timed from the prefill's token on, so this changes no figure.
HF_DECODE_PREFILL_CHUNK = 512


def hf_decode(prompt, batch, new_tokens, repeats: int = 3, name: str = "issue"):
    """transformers' `generate`, timed the same way: a stopping criterion stamps every new token
    (the prompt prefilled HF_DECODE_PREFILL_CHUNK tokens at a time)."""
    import torch
    import transformers

    class Stamps(transformers.StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    cfg = model_config(name)
    model = hf_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))

    def run(n=new_tokens):
        stamps = Stamps()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, stopping_criteria=[stamps],
                           prefill_chunk_size=HF_DECODE_PREFILL_CHUNK)
        return stamps.times[-1] - stamps.times[0]

    start = time.perf_counter()
    run(2)
    return {"compile_s": time.perf_counter() - start, "decode_s": [run() for _ in range(repeats)]}


def jax_prefill(name, prompt, batch, repeats: int = 2, page_size: int = 0):
    """Time to the first token: `generate(model, prompts, 1)` (chunked prefill + one sampled token)
    after a first call that compiles, per run; through a paged cache of `page_size`-token pages
    (0: the contiguous cache)."""
    import jax
    from flax import nnx

    from dsv3_jax import DeepSeekV3
    from dsv3_jax.inference import generate

    cfg = model_config(name)
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, prompt)).astype(np.int32)
    paged = dict(page_size=page_size) if page_size else {}  # a --baseline tree may predate page_size
    first, times = _timed_steps(lambda: jax.block_until_ready(generate(model, prompts, 1, **paged)), repeats)
    return {"compile_s": first - min(times), "prefill_s": times}


def hf_prefill(name, prompt, batch, repeats: int = 2, page_size: int = 0):
    """transformers' `generate(..., max_new_tokens=1)`, timed the same way (a first untimed call);
    `page_size` is dsv3-jax's only (transformers' cache here is its contiguous one)."""
    import torch

    cfg = model_config(name)
    model = hf_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))

    def run():
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                           do_sample=False, pad_token_id=0)

    first, times = _timed_steps(run, repeats)
    return {"compile_s": first - min(times), "prefill_s": times}


def jax_trainer(steps):
    """The training loop (dsv3_jax/train/loop.py) end to end on the issue config and the bundled corpus: mean step time of
    each logging window of `steps` steps after the first (which compiles)."""
    try:
        from dsv3_jax.train.loop import train
    except ImportError:  # a --baseline tree from before the loop moved into the library
        from experiments.train import train
    from experiments.configs import tiny

    config = tiny.get_config()
    with config.unlocked():
        config.model.update({k: v for k, v in BENCH_CONFIG.items() if k != "yarn"})
        config.model.yarn = None
        config.data.seq_len, config.data.batch_size = 256, 8
        config.train.update(steps=3 * steps, log_every=steps, eval_every=0, checkpoint_every=10**9, compilation_cache="",
                            workdir=tempfile.mkdtemp(prefix="bench_trainer_"))
    records = train(config)
    return {"step_s": [8 * 256 / r["tokens_per_sec"] for r in records[1:]]}


def jax_peak(n: int = 2048) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    return 2.0 * n**3 / min(_once(lambda: mm(a).block_until_ready()) for _ in range(5))


def torch_peak(n: int = 2048) -> float:
    import torch

    a = torch.ones((n, n))
    return 2.0 * n**3 / min(_once(lambda: a @ a) for _ in range(5))


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


WORKERS = {"jax_train": jax_train, "hf_train": hf_train, "jax_decode": jax_decode, "hf_decode": hf_decode,
           "jax_prefill": jax_prefill, "hf_prefill": hf_prefill, "jax_trainer": jax_trainer}

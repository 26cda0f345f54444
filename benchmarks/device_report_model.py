"""The device report's model rows: a train step of the largest config that fits the chip, in bf16
and with the FP8 recipe, as MFU; prefill and decode tokens/s of that model through `generate`.

The config (`scaled_config`) keeps the 671B's widths (hidden 7168, 128 heads, the MLA ranks,
experts of 2048, top-8 in 8 groups keeping 4, one shared expert, the vocabulary), so every matmul
has the 671B's per-token shape; it has `ModelShapes.routed_experts` routed experts, no MTP, the first
layer dense, and as many layers as `fit` finds room for: parameters (fp32), gradients
(fp32) and AdamW's two moments (bf16, the paper's recipe) per parameter, plus the activations of
`experiments/plan_memory.py` for one device, within `memory_fraction` of the device's memory.

MFU: `dsv3_jax/train/metrics.py:flops_per_token` (6 x the matmul weights one token meets, the
top-k and shared experts only, plus causal attention's scores and weighted sums) x tokens a second,
over the chip's dense bf16 peak, for both recipes (so the two compare; the FP8 recipe runs its
projections on FP8 tensor cores, whose peak is twice that).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.bench_workers import train_parts
from benchmarks.peaks import Peak
from dsv3_jax import DeepSeekV3, ModelConfig
from dsv3_jax.inference import generate
from dsv3_jax.train.metrics import flops_per_token
from experiments import plan_memory


class _Section(dict):
    """A config section read as attributes and with .get, as `make_optimizer` reads ml_collections'."""

    __getattr__ = dict.__getitem__


# AdamW as in the paper (section 4.2), moments in bf16 (section 3.3.3); no warmup, so every timed
# step updates.
OPTIMIZER = _Section(schedule="wsd", peak_lr=2.2e-4, end_lr=2.2e-5, warmup_steps=0, decay_fraction=0.2, b1=0.9,
                     b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, moment_dtype="bfloat16")
STATE_BYTES_PER_PARAM = 4 + 4 + 2 + 2  # fp32 weight and gradient, two bf16 moments


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    seq: int = 4096  # the 671B's pretraining length
    batch: int = 1
    steps: int = 3  # timed train steps after the one that compiles
    routed_experts: int = 16
    memory_fraction: float = 0.8  # of the device's memory that the planned state and activations may take
    max_layers: int = 61
    infer_batch: int = 16
    infer_prompt: int = 2048
    infer_new: int = 32
    smoke: bool = False  # the tiny preset (`ModelConfig.tiny`), for the CPU smoke run


SMOKE_MODEL = ModelShapes(seq=32, batch=2, steps=1, infer_batch=2, infer_prompt=16, infer_new=4, smoke=True)


def scaled_config(sh: ModelShapes, layers: int, **fields) -> ModelConfig:
    """The 671B with `layers` layers (the first dense) and `sh.routed_experts` experts, no MTP."""
    if sh.smoke:
        return ModelConfig.tiny(num_layers=2, num_mtp_layers=0, **fields)
    return ModelConfig.deepseek_v3(num_layers=layers, num_dense_layers=1, num_routed_experts=sh.routed_experts,
                                   num_mtp_layers=0, **fields)


def planned_bytes(cfg: ModelConfig, batch: int, seq: int) -> int:
    """One device's train state and step activations (`experiments/plan_memory.py`, as lowered for
    a GPU: ragged_dot experts; the flash kernel's blocks with attention_impl="pallas", else XLA
    attention's [B, H, T, T] probabilities in one layer's backward)."""
    tokens = batch * seq
    groups = [plan_memory.LayerGroup(cfg.num_dense_layers, tokens, tokens, False),
              plan_memory.LayerGroup(cfg.num_moe_layers, tokens, tokens, True)]
    acts = plan_memory.activation_bytes(cfg, seq, groups, program=plan_memory.program_for(cfg, "gpu"),
                                        logit_tokens=tokens)
    return STATE_BYTES_PER_PARAM * cfg.param_counts()["total"] + sum(acts.values())


def fit(sh: ModelShapes, memory_bytes: int | None, **fields) -> tuple[int, int]:
    """(layers, seq): the most layers (2 .. max_layers: one dense, the rest MoE) whose planned bytes
    fit `memory_fraction` of `memory_bytes` at `sh.seq`, or at half of it while two layers do not fit
    (down to 1024 tokens); (2, sh.seq) where the memory is unknown (None) or nothing fits."""
    for seq in (sh.seq, sh.seq // 2, sh.seq // 4):
        fits = [n for n in range(2, sh.max_layers + 1) if memory_bytes and seq >= min(1024, sh.seq)
                and planned_bytes(scaled_config(sh, n, **fields), sh.batch, seq) <= sh.memory_fraction * memory_bytes]
        if fits:
            return max(fits), seq
    return 2, sh.seq


def device_memory() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return stats.get("bytes_limit") if stats else None


def _describe(cfg: ModelConfig, sh: ModelShapes) -> dict:
    counts = cfg.param_counts()
    return {"layers": cfg.num_layers, "routed_experts": cfg.num_routed_experts, "hidden": cfg.hidden_size,
            "params": counts["total"], "activated_params": counts["activated"], "batch": sh.batch, "seq": sh.seq,
            "attention_impl": cfg.attention_impl, "fp8_matmul": cfg.fp8_matmul,
            "planned_gib": planned_bytes(cfg, sh.batch, sh.seq) / 2**30}


def planned(sh: ModelShapes, **fields) -> tuple[ModelConfig, ModelShapes]:
    """The config `fit` plans for this device, and the shapes with its sequence length."""
    layers, seq = fit(sh, device_memory(), **fields)
    return scaled_config(sh, layers, **fields), dataclasses.replace(sh, seq=seq)


def train(sh: ModelShapes, peak: Peak | None, *, fp8: bool, attention_impl: str) -> dict:
    """Step time, tokens/s, TFLOP/s and MFU of the planned config; if its first step runs out of
    memory, once more at half its layers (the first error kept in the row)."""
    fields = dict(fp8_matmul=fp8, attention_impl=attention_impl)
    cfg, sh = planned(sh, **fields)
    try:
        return _train(cfg, sh, peak)
    except Exception as e:  # noqa: BLE001 (any failure of the step is the row's result)
        if "RESOURCE_EXHAUSTED" not in str(e) or cfg.num_layers <= 2:
            raise
        first = str(e).strip().splitlines()[0][:300]
    row = _train(scaled_config(sh, max(2, cfg.num_layers // 2), **fields), sh, peak)
    return row | {"first_try": f"{cfg.num_layers} layers: {first}"}


def _train(cfg: ModelConfig, sh: ModelShapes, peak: Peak | None) -> dict:
    step, state, data = train_parts(cfg, OPTIMIZER, sh.batch, sh.seq)
    start = time.perf_counter()
    state, metrics = step(state, data)
    jax.block_until_ready(metrics["loss"])
    first = time.perf_counter() - start
    times = []
    for _ in range(sh.steps):
        start = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    tokens_per_s = sh.batch * sh.seq / step_s
    tflops = flops_per_token(cfg, sh.seq) * tokens_per_s / 1e12
    return {"config": _describe(cfg, sh), "step_s": step_s, "compile_s": first - step_s, "tokens_per_s": tokens_per_s,
            "tflops": tflops, "mfu": tflops / peak.bf16_tflops if peak else None,
            "loss": float(metrics["loss"]), "flops_per_token": flops_per_token(cfg, sh.seq)}


def inference(sh: ModelShapes, *, attention_impl: str) -> dict:
    """Greedy `generate` of `infer_new` tokens after random prompts, twice (the first compiles):
    prefill tokens/s (prompt tokens over the second call's prefill) and decode tokens/s (its
    steps after the first), for the model the train rows plan, its weights in bf16, its cache in
    the compute dtype."""
    cfg, _ = planned(sh, attention_impl=attention_impl)
    cfg = cfg.replace(param_dtype="bfloat16")
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (sh.infer_batch, sh.infer_prompt), np.int32)
    start = time.perf_counter()
    generate(model, prompts, sh.infer_new)
    first = time.perf_counter() - start
    _, stats = generate(model, prompts, sh.infer_new, return_stats=True)
    return {"config": _describe(cfg, sh) | {"batch": sh.infer_batch, "prompt": sh.infer_prompt,
                                            "new_tokens": sh.infer_new},
            "prefill_s": stats.prefill_seconds, "prefill_tokens_per_s": prompts.size / stats.prefill_seconds,
            "decode_tokens_per_s": stats.tokens_per_second, "first_call_s": first}

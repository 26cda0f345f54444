"""Activation memory of one train step, per device, counted from the tensors the program holds.

Letters: N tokens a layer works on (this device's), S sequence length, B = N / S sequences,
D model, H heads, Q/V query-key/value head dims, L_q/L_kv the MLA low-rank widths, I dense width,
F expert width, F_s shared-expert width, E experts, K experts per token, M = N*K (token, slot)
rows, P devices on the `expert` axis, C rows sent to each of them, R = P*C rows received (M without
expert parallelism), G rows the grouped matmul holds (below), b the compute dtype's bytes.

The step's memory peaks where the backward starts (every layer's saved tensors live, the first
backward layer at work) or, with per-layer remat, inside one layer's backward. Counted:

- saved per layer (no remat; what autodiff keeps for the backward, `jax.ad_checkpoint`'s
  residuals of one block): the residual stream and norms, 4 fp32 + 3 b x [N, D] (each RMSNorm's
  normalised and scaled input, the layer input, the attention sum); MLA 3 x [N, L_q + L_kv] (the
  down-projection and its RMSNorm) and [N, H, 2Q + 2V] (q, k, v, the heads' output); each SwiGLU
  6 x [rows, width] (gate, up, three silu intermediates, their product); the MoE router's
  fp32 [N, E] scores and the combine's [N, K, D] rows; the routed experts' rows below.
  With per-layer remat only the layer input [N, D] is saved.
- routed rows: `ragged_dot` (TPU, GPU) holds the R rows: [R, D] + 6 x [R, F]. The tiled grouped
  matmul (XLA:CPU) pads each expert's rows to a tile t, G = (ceil(R / t) + local experts) * t rows.
  One tile loop serves both the single-device dispatch and the expert-parallel receive side; it
  has its own backward and keeps [G, D] + 2 x [G, F] (the tiles' rows, gate and up).
  Expert parallelism adds bool [R, D] x 3 and [M, D] x 2 (the masks of padding rows).
- gathered expert weights: on a mesh that splits tokens but not experts (`token_parallel`), each
  MoE layer's experts are gathered whole, 3 x [E, D, F] per layer, and kept for the backward.
- one layer's backward (the working set): its recomputed saved tensors (remat), the gradients
  of its rows ([G, D] x 4 + [G, F] tiled; [R, D] + 2 x [R, F] ragged), naive attention's
  [B, H, S, S] probabilities and their gradient in fp32 and the scores' gradient in b
  (`ops/attention.py`'s backward; the flash kernel, `attention_impl="pallas"`, holds blocks
  only), and the dense layer's 3 x [N, I].
- expert-parallel buffers (P > 1), per direction (the forward, recomputed or not, and its
  transpose): padded exchange, [R, D] x 6 (send, receive, result, return; the receive side's
  scattered and masked results) and [M, D] x 2 (the sender's sorted and unsorted results);
  ragged exchange, [R, D] x 3 and [M, D] x 3 (no padded send buffer; the gathered rows instead).
  Dropless, C = M: the worst case of every peer sending all its rows to one device.
- logits: fp32 [N, vocab] of the main head and of each MTP depth, with their gradients, N the
  tokens of one outer microbatch (`model.outer_microbatches`: the layers outside the stack run
  one slice of the device's rows at a time, so their saved tensors and working set are a slice's).
- pipeline stack (stages > 1, `stack_schedule`): the saved tensors of the microbatches in flight
  on a stage at the backward's peak: GPipe and circular every microbatch (M) on every slot; 1F1B
  the S stash slots of `sharding/pipeline.py:_one_f_one_b_backward` on the stage's slots;
  DualPipeV the stash slots its table assigns (`sharding/dualpipev.py:schedule_table`), each one
  chunk of ceil(L / 2S) slots. Full-batch buffers [tokens, D]: GPipe keeps the stack's input and
  output; the hand-run backwards keep the input (their custom_vjp's residual), the output's
  cotangent and the input gradient, each split over the stages on the microbatch dimension (1/S of
  the batch each) when S divides M (`sharding/stage_batch.py`: one microbatch at a time moves
  between its owner and the stage that reads or writes it), whole on every stage otherwise.
  DualPipeV adds its inboxes and the cotangents W waits on.

The counts were read off the program: jax's saved residuals of one block and of
`dispatch.local_expert_mlp` for each grouped-matmul implementation, and the buffers live at the
peak in XLA:CPU's buffer assignment of the compiled step (`--xla_dump_to`). The CPU program's
plan is checked against `memory_analysis()` of the compiled step (tests/sharding/test_plan.py);
the TPU program's rows (`ragged_dot`, ragged exchange) follow the same count and have not been
compared with a TPU compile. Not counted: the copy of the AdamW moments XLA:CPU makes for the
update (it reads the old moments after writing the new ones in place). The stage's copy of its
layer slots (uneven splits, circular rounds, DualPipeV's V) is not an activation: experiments/plan.py
counts it (`_slot_copy_bytes`). The pipelined tiny steps (GPipe, 1F1B with an uneven split,
DualPipeV on pipeline=4 x data=2) are checked against the compiler like the others.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from dsv3_jax import ModelConfig
from dsv3_jax.ops import tile_loop
from sharding import dualpipev, expert_parallel, pipeline, stage_batch


class LayerGroup(NamedTuple):
    layers: int  # layers of this kind this device runs
    saved_tokens: int  # tokens whose saved tensors it keeps per layer
    live_tokens: int  # tokens one layer works on at once (a microbatch in the pipeline)
    moe: bool


class Stack(NamedTuple):
    """What one stage of the pipelined stack keeps at the backward's peak (module docstring)."""

    slots: int  # layer slots whose saved tensors one microbatch in flight holds
    in_flight: int  # microbatches (or DualPipeV stash slots) in flight
    batch_buffers: int  # [stage tokens, D] buffers of the whole stack batch
    batch_split: int  # stages each of those is split over (1: whole on every stage)
    micro_buffers: int  # [microbatch tokens, D] buffers (DualPipeV's inboxes and W's cotangents)


def stack_schedule(schedule: str, stages: int, micro: int, num_layers: int, repeats: int = 1) -> Stack:
    """The pipelined stack's in-flight count under `schedule` (sharding/pipeline.py's SCHEDULES)."""
    split = stages if stage_batch.splits_stack_batch(schedule, micro, stages) else 1
    if schedule == "1f1b":
        return Stack(pipeline.slots_per_stage(num_layers, stages), stages, 3, split, 2)
    if schedule == "dualpipev":
        table = dualpipev.schedule_table(stages, micro)
        return Stack(-(-num_layers // (2 * stages)), table.stash, 3, split,
                     table.inbox_a + table.inbox_g + table.wait_w)
    return Stack(pipeline.slots_per_stage(num_layers, stages, repeats), micro, 2, 1, 0)


class Program(NamedTuple):
    """The implementation choices of the program lowered for one platform."""

    grouped: str  # "ragged" (ragged_dot, fp8) or "tiled"
    exchange: str  # "ragged" or "padded"
    flash: bool  # attention keeps no [S, S] probabilities


def program_for(cfg: ModelConfig, platform: str) -> Program:
    """`auto` choices as dispatch.py and expert_parallel.py make them for `platform`. The fp8
    kernel is counted as `ragged_dot` (same rows); the `dense` reference is not modelled."""
    cpu = platform == "cpu"
    grouped = "tiled" if cfg.moe_impl == "tiled" or (cfg.moe_impl == "auto" and cpu) else "ragged"
    exchange = cfg.expert_exchange if cfg.expert_exchange != "auto" else ("padded" if cpu else "ragged")
    return Program(grouped, exchange, cfg.attention_impl == "pallas")


def received_rows(cfg: ModelConfig, tokens: int, experts_axis: int, capacity_factor) -> int:
    """R: rows of one device's expert-parallel receive buffer for `tokens` tokens, P * C with C the
    rows sent to each peer (sharding/expert_parallel.py); the tokens' own M = tokens * K without EP."""
    m = tokens * cfg.num_experts_per_token
    if experts_axis <= 1:
        return m
    return experts_axis * expert_parallel.capacity(m, experts_axis, capacity_factor)


def grouped_rows(rows: int, experts: int, grouped: str, max_tile: int) -> int:
    """G: rows the grouped matmul holds for `rows` rows over `experts` experts (dispatch.py)."""
    if grouped != "tiled":
        return rows
    t = tile_loop.tile_rows(rows, experts, max_tile)
    return (-(-rows // t) + min(experts, rows)) * t


class _Shapes(NamedTuple):
    n: int  # N
    m: int  # M
    r: int  # R
    g: int  # G


def _shapes(cfg: ModelConfig, tokens: int, experts_axis: int, program: Program) -> _Shapes:
    r = received_rows(cfg, tokens, experts_axis, cfg.expert_capacity_factor)
    g = grouped_rows(r, cfg.num_routed_experts // experts_axis, program.grouped, cfg.moe_tile_size)
    return _Shapes(tokens, tokens * cfg.num_experts_per_token, r, g)


def layer_saved_bytes(cfg: ModelConfig, tokens: int, moe: bool, experts_axis: int, program: Program,
                      gathers_experts: bool) -> int:
    """Bytes one layer keeps for its backward without remat (module docstring)."""
    b, d, s = jnp.dtype(cfg.compute_dtype).itemsize, cfg.hidden_size, _shapes(cfg, tokens, experts_axis, program)
    n = s.n
    out = n * d * (4 * 4 + 3 * b)
    out += 3 * n * (cfg.q_lora_rank + cfg.kv_lora_rank) * b + n * cfg.num_heads * 2 * (cfg.qk_head_dim + cfg.v_head_dim) * b
    if not moe:
        return out + 6 * n * cfg.intermediate_size * b
    f = cfg.moe_intermediate_size
    out += 6 * n * f * cfg.num_shared_experts * b + n * cfg.num_routed_experts * 4 + s.m * d * b
    if program.grouped == "tiled":
        out += s.g * (d + 2 * f) * b
    else:
        out += s.r * (d + 6 * f) * b
    if experts_axis > 1:
        out += 3 * s.r * d + 2 * s.m * d
    if gathers_experts:
        out += 3 * cfg.num_routed_experts * d * f * b
    return out


def layer_backward_bytes(cfg: ModelConfig, tokens: int, seq: int, moe: bool, experts_axis: int,
                         program: Program) -> int:
    """Gradients one layer's backward holds beyond its saved tensors (module docstring)."""
    b, d, s = jnp.dtype(cfg.compute_dtype).itemsize, cfg.hidden_size, _shapes(cfg, tokens, experts_axis, program)
    seqs = max(1, s.n // seq)
    out = 0 if program.flash else seqs * cfg.num_heads * seq * seq * (2 * 4 + b)
    if not moe:
        return out + 3 * s.n * cfg.intermediate_size * b
    f = cfg.moe_intermediate_size
    if program.grouped == "tiled":
        return out + s.g * (4 * d + f) * b
    return out + (s.r * d + 2 * s.r * f) * b


def exchange_bytes(cfg: ModelConfig, tokens: int, experts_axis: int, program: Program) -> int:
    """The expert-parallel exchange's buffers in one layer, forward and transpose (0 without EP)."""
    if experts_axis <= 1:
        return 0
    b, d, s = jnp.dtype(cfg.compute_dtype).itemsize, cfg.hidden_size, _shapes(cfg, tokens, experts_axis, program)
    per_direction = 6 * s.r + 2 * s.m if program.exchange == "padded" else 3 * s.r + 3 * s.m
    return 2 * per_direction * d * b


def activation_bytes(cfg: ModelConfig, seq: int, groups: list[LayerGroup], *, program: Program,
                     experts_axis: int = 1, stages: int = 1, gathers_experts: bool = False,
                     logit_tokens: int, stack: Stack | None = None, stack_tokens: int = 0) -> dict[str, int]:
    """The activation rows of the plan, bytes per device (module docstring). With `stack`, the last
    group is the pipelined stack (saved tokens: those of the microbatches in flight) and
    `stack_tokens` the tokens of a stage's whole stack batch."""
    b, d = jnp.dtype(cfg.compute_dtype).itemsize, cfg.hidden_size
    groups = [g for g in groups if g.layers]

    def saved(g: LayerGroup, tokens: int) -> int:
        return layer_saved_bytes(cfg, tokens, g.moe, experts_axis, program, gathers_experts and g.moe)

    kept = sum(g.layers * (g.saved_tokens * d * b if cfg.remat else saved(g, g.saved_tokens)) for g in groups)
    # with remat, the layer at work recomputes its saved tensors for the tokens it works on
    work = max((saved(g, g.live_tokens) if cfg.remat else 0)
               + layer_backward_bytes(cfg, g.live_tokens, seq, g.moe, experts_axis, program) for g in groups)
    out = {"saved layer inputs" if cfg.remat else "saved for the backward": kept,
           "one layer's backward": work}
    if experts_axis > 1:
        out["expert-parallel buffers"] = max((exchange_bytes(cfg, g.live_tokens, experts_axis, program)
                                              for g in groups if g.moe), default=0)
    out["logits (+grad)"] = 2 * (1 + cfg.num_mtp_layers) * logit_tokens * cfg.vocab_size * 4
    if stages > 1 and stack is not None:
        micro = groups[-1].live_tokens
        whole = stack.batch_buffers * stack_tokens // stack.batch_split
        out["pipeline buffers"] = (whole + stack.micro_buffers * micro) * d * b
    return out


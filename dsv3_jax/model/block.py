"""Pre-norm transformer block: x += MLA(norm(x)); x += FFN(norm(x)), FFN dense or MoE."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.config import ModelConfig
from dsv3_jax.model.attention import MLA
from dsv3_jax.model.mlp import MLP
from dsv3_jax.model.moe import MoE, RouterStats
from dsv3_jax.model.norm import RMSNorm
from sharding import pipeline


class Context(NamedTuple):
    """Per-batch inputs every layer reads."""

    cos: jax.Array  # [B, T, R/2]
    sin: jax.Array  # [B, T, R/2]
    segment_ids: jax.Array | None  # [B, T] documents of a packed row (0 = padding)
    token_mask: jax.Array | None  # [B, T] bool, tokens that count in router statistics


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, moe: bool, rngs: nnx.Rngs):
        d, pd = cfg.hidden_size, cfg.param_dtype
        self.attn_norm = RMSNorm(d, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd)
        self.attn = MLA(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(d, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd)
        if moe:
            self.ffn = MoE(cfg, rngs=rngs)
        else:
            self.ffn = MLP(d, cfg.intermediate_size, std=cfg.initializer_range, param_dtype=pd,
                           compute_dtype=cfg.compute_dtype, rngs=rngs, fp8=cfg.fp8_matmul)

    def __call__(self, x_BxTxD: jax.Array, ctx: Context) -> tuple[jax.Array, RouterStats | None]:
        x = x_BxTxD + self.attn(self.attn_norm(x_BxTxD), ctx.cos, ctx.sin, ctx.segment_ids)
        if isinstance(self.ffn, MoE):
            y, stats = self.ffn(self.ffn_norm(x), ctx.token_mask)
        else:
            y, stats = self.ffn(self.ffn_norm(x)), None
        return x + y, stats


def run_stack(blocks: Block, x_BxTxD: jax.Array, ctx: Context, *, remat: bool):
    """Runs layer-stacked blocks with one scan (compile time flat in depth).

    Returns (x, per-layer stats stacked on a leading axis, or None for dense blocks).
    """

    def body(x, block):
        return block(x, ctx)

    if remat:
        body = nnx.remat(body)
    return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x_BxTxD, blocks)


def run_stack_pipelined(blocks: Block, x_BxTxD: jax.Array, ctx: Context, *, remat: bool, mesh,
                        microbatches: int = 0, repeats: int = 1):
    """`run_stack` for MoE blocks on a mesh with a `pipeline` axis: the layers split into stages,
    the batch into microbatches, run by the GPipe (repeats=1) or circular schedule of
    sharding/pipeline.py.

    Same results as `run_stack`: stats are summed (expert counts) or averaged (the sequence-wise
    balance loss and the dropped fraction, means over equal-sized microbatches) over the microbatches.
    """
    graphdef, state = nnx.split(blocks)
    num_layers = jax.tree.leaves(state)[0].shape[0]
    m = pipeline.check_schedule(mesh, num_layers=num_layers, batch=x_BxTxD.shape[0], microbatches=microbatches,
                                repeats=repeats)

    def layer(p, x, side):
        return nnx.merge(graphdef, p)(x, Context(*side))

    if remat:
        layer = jax.checkpoint(layer)
    side = jax.tree.map(lambda a: pipeline.split_microbatches(a, m), tuple(ctx))
    y, stats = pipeline.pipeline_apply(layer, state, pipeline.split_microbatches(x_BxTxD, m), side, mesh=mesh,
                                       repeats=repeats)
    stats = RouterStats(jnp.sum(stats.expert_counts, axis=1), jnp.mean(stats.balance_loss, axis=1),
                        jnp.mean(stats.dropped_fraction, axis=1))
    return pipeline.merge_microbatches(y), stats

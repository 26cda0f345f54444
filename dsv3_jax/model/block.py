"""Pre-norm transformer block: x += MLA(norm(x)); x += FFN(norm(x)), FFN dense or MoE.

With a latent cache the same block serves inference: MLA runs its absorbed form over the cache
and the stack writes each layer's new entries in place (`run_stack`). With `indexer_loss` (training
DeepSeek Sparse Attention's indexer) a block also returns its indexer's KL to the main attention.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import params
from dsv3_jax.model.attention import MLA, LatentCache
from dsv3_jax.model.indexer import indexer_kl
from dsv3_jax.model.mlp import MLP
from dsv3_jax.model.moe import MoE, RouterStats
from dsv3_jax.model.norm import RMSNorm
from sharding import pipeline, stage_batch


class Context(NamedTuple):
    """Per-batch inputs every layer reads."""

    cos: jax.Array  # [B, T, R/2]
    sin: jax.Array  # [B, T, R/2]
    segment_ids: jax.Array | None  # [B, T] documents of a packed row (0 = padding)
    token_mask: jax.Array | None  # [B, T] bool, tokens that count in router statistics
    positions: jax.Array | None = None  # [B, T] positions = cache slots written; None without a cache
    page_table: jax.Array | None = None  # int [B, M] of a paged cache (`ModelCache.page_table`); else None


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, moe: bool, rngs: nnx.Rngs):
        d, pd = cfg.hidden_size, cfg.param_dtype
        self.attn_norm = RMSNorm(d, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd)
        self.attn = MLA(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(d, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd)
        self.ffn = MoE(cfg, rngs=rngs) if moe else MLP(d, cfg.intermediate_size, std=cfg.initializer_range,
                                                       param_dtype=pd, compute_dtype=cfg.compute_dtype, rngs=rngs,
                                                       fp8=cfg.fp8_matmul)

    def __call__(self, x_BxTxD: jax.Array, ctx: Context, cache: LatentCache | None = None, layer=None, *,
                 indexer_loss: bool = False):
        """x [B, T, D] -> (x, router stats | None); with this layer's `cache` [B, S, ...] (or a stack
        [L, B, S, ...] read at `layer`) also the entries [B, T, ...] to store at `ctx.positions`:
        (x, stats, entries); with `indexer_loss` (no cache) the indexer's KL [] instead of entries."""
        h = self.attn_norm(x_BxTxD)
        if indexer_loss:
            a, terms = self.attn.expanded(h, ctx.cos, ctx.sin, ctx.segment_ids, indexer_terms=True)
            extra = indexer_kl(*terms, ctx.token_mask)
        else:
            a = self.attn(h, ctx.cos, ctx.sin, ctx.segment_ids, cache=cache, positions=ctx.positions, layer=layer,
                          page_table=ctx.page_table)
            a, extra = a if cache is not None else (a, None)
        x = x_BxTxD + a
        if isinstance(self.ffn, MoE):
            stacked = layer is not None and self.ffn.w1.ndim == 4  # run_stack's cached path: experts read in place
            y, stats = self.ffn(self.ffn_norm(x), ctx.token_mask, layer if stacked else None)
        else:
            y, stats = self.ffn(self.ffn_norm(x)), None
        return (x + y, stats) if extra is None else (x + y, stats, extra)


def _routed_expert_weights(path, _) -> bool:
    """The MoE's routed-expert weights (ffn.w1 / w3 / w2), not the shared expert's."""
    return len(path) >= 2 and path[-2] == "ffn" and path[-1] in ("w1", "w3", "w2")


def run_stack(blocks: Block, x_BxTxD: jax.Array, ctx: Context, *, remat: bool, cache: LatentCache | None = None,
              unroll_max_layers: int = 0, indexer_loss: bool = False):
    """Runs layer-stacked blocks with one scan (compile time flat in depth).

    Returns (x, per-layer stats stacked on a leading axis or None for dense blocks, cache), or with
    `indexer_loss` (x, stats, each layer's indexer KL [L]). A
    stacked `cache` [L, B, S, ...] is only read inside the scan (each layer attends to its slots
    before `ctx.positions` and to its own new entries) and every layer's entries are written at
    `ctx.positions` after it, in one scatter: carried through the scan instead, XLA:CPU copied the
    whole cache twice a step; without a cache the returned cache is None. With a cache (inference, where
    a token reads only its top-k experts) the routed experts' weights are not sliced per layer but
    read in place from the stack, so a step does not copy every expert's weights of every layer.
    Without a cache a stack of at most `unroll_max_layers` layers runs unrolled, with no loop at all
    (`unroll=0`: True would leave a one-trip loop for one layer); see dsv3_jax/host.py:tune_model.
    """
    if cache is not None:
        def cached(x, block, layer):
            x, stats, entries = block(x, ctx, cache, layer)  # read in place: no per-layer copy
            return x, (stats, entries)

        num_layers = cache.latent.shape[0]
        blocks_axes = nnx.StateAxes({_routed_expert_weights: None, ...: 0}) if isinstance(blocks.ffn, MoE) else 0
        scan = nnx.scan(cached, in_axes=(nnx.Carry, blocks_axes, 0), out_axes=(nnx.Carry, 0))
        x, (stats, entries_L) = scan(x_BxTxD, blocks, jnp.arange(num_layers))
        return x, stats, cache.write(entries_L, ctx.positions, slice(None), ctx.page_table)

    constrain = params.layer_constraint(blocks)
    num_layers = jax.tree.leaves(nnx.state(blocks))[0].shape[0]

    def body(x, block):
        x, *per_layer = constrain(block)(x, ctx, indexer_loss=indexer_loss)
        return x, tuple(per_layer)

    if remat:
        body = nnx.remat(body)
    unroll = 0 if num_layers <= unroll_max_layers else 1
    scan = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), unroll=unroll)
    x, (stats, *kl_L) = scan(x_BxTxD, blocks)
    return x, stats, kl_L[0] if indexer_loss else None


def run_stack_pipelined(blocks: Block, x_BxTxD: jax.Array, ctx: Context, *, remat: bool, mesh,
                        microbatches: int = 0, repeats: int = 1, schedule: str | None = None):
    """`run_stack` for MoE blocks on a mesh with a `pipeline` axis: the layers split into stages,
    the batch into microbatches, run by `schedule` of sharding/pipeline.py (default GPipe, or
    circular when repeats > 1).

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
    stages, shards = mesh.shape["pipeline"], pipeline.stage_batch_shards(mesh)
    if stage_batch.splits_stack_batch(schedule, m, stages):  # the batch stays split over the stages
        split = lambda a: stage_batch.split_stage_microbatches(a, m, stages, shards)  # noqa: E731
        merge = lambda y: stage_batch.merge_stage_microbatches(y, stages, shards)  # noqa: E731
    else:
        split, merge = lambda a: pipeline.split_microbatches(a, m), pipeline.merge_microbatches  # noqa: E731
    side = jax.tree.map(split, tuple(ctx))
    y, stats = pipeline.pipeline_apply(layer, state, split(x_BxTxD), side, mesh=mesh, repeats=repeats,
                                       schedule=schedule, stored_specs=params.stack_specs(state))
    stats = RouterStats(jnp.sum(stats.expert_counts, axis=1), jnp.mean(stats.balance_loss, axis=1),
                        jnp.mean(stats.dropped_fraction, axis=1))
    return merge(y), stats

"""DeepSeekV3: embedding, dense-then-MoE layer stacks (scanned), final norm, head, MTP.

One forward for training and inference: `forward(tokens)` is the training pass; with a
`ModelCache` the same modules run MLA's absorbed form over the latent cache and write the tokens'
entries at their positions (a prefill chunk, a decode step or a speculative verify window), and
`mtp_depth` runs one MTP depth the same way for drafting.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import params
from dsv3_jax.model.attention import LatentCache
from dsv3_jax.model.block import Block, Context, run_stack, run_stack_pipelined
from dsv3_jax.model.moe import RouterStats
from dsv3_jax.model.mtp import MTPLayer, run_mtp
from dsv3_jax.model.norm import RMSNorm
from dsv3_jax.model.rope import rope_angles
from dsv3_jax.ops.latent_attention import row_slots
from sharding import pipeline


class ModelCache(NamedTuple):
    """The latent cache of every stack; layouts (dtypes, sizes) come from `dsv3_jax.inference.cache`.
    Paged (`page_table` set): every stack is a pool of pages [L, N, K, ...], one page id naming the
    same page in each, and the table says which pages hold the rows of this call."""

    dense: LatentCache | None  # [L_dense, B, S, ...] or paged [L_dense, N, K, ...]
    moe: LatentCache | None  # [L_moe, B, S, ...] or paged [L_moe, N, K, ...]
    mtp: LatentCache | None  # [M, B, S, ...] or paged [M, N, K, ...]
    page_table: jax.Array | None = None  # int32 [B, M]: row b's slot s in page [b, s // K] (-1: none)

    @property
    def slots(self) -> int:
        """Positions a row can address: S, or M x K through the page table."""
        return row_slots(next(c for c in self[:3] if c is not None).latent, self.page_table)


class ModelOutput(NamedTuple):
    logits: jax.Array  # float32 [B, T, V], main head
    hidden: jax.Array  # [B, T, D] after the final norm
    router_stats: RouterStats | None  # leaves stacked [L_moe, ...]
    mtp_logits: jax.Array | None  # float32 [M, B, T, V]; depth k at i predicts t_{i+k+1}
    mtp_router_stats: RouterStats | None  # leaves stacked [M, ...]
    cache: ModelCache | None = None  # the updated cache when one was given
    mtp_hidden: jax.Array | None = None  # [M, B, T, D] the MTP depths' head inputs (mtp_logits before the head)
    indexer_loss: jax.Array | None = None  # [] the indexers' KL summed over the layers (and MTP depths run)


def check_tokens(tokens, vocab_size: int) -> None:
    """Clear errors for bad token input; value checks only when the array is concrete."""
    if not hasattr(tokens, "ndim") or tokens.ndim != 2:
        raise ValueError(f"tokens must be an int array [batch, length], got shape {np.shape(tokens)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    if isinstance(tokens, jax.core.Tracer) or tokens.size == 0:
        return
    ids = np.asarray(tokens)  # concrete: check on the host, even when called inside a trace
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    if bad.size:
        b, t = bad[0]
        raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}); got {int(ids[b, t])} "
                         f"at [batch={b}, position={t}]")


class DeepSeekV3(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = cfg
        d, v, std, pd = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range, cfg.param_dtype
        self.embed = params.normal(rngs, (v, d), ("vocab", "embed"), std=std, dtype=pd)
        self.dense_layers = (params.stack_layers(lambda r: Block(cfg, moe=False, rngs=r), cfg.num_dense_layers, rngs)
                             if cfg.num_dense_layers else None)
        self.moe_layers = (params.stack_layers(lambda r: Block(cfg, moe=True, rngs=r), cfg.num_moe_layers, rngs)
                           if cfg.num_moe_layers else None)
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd)
        self.head = params.normal(rngs, (d, v), ("embed", "vocab"), std=std, dtype=pd)
        self.mtp = (params.stack_layers(lambda r: MTPLayer(cfg, rngs=r), cfg.num_mtp_layers, rngs)
                    if cfg.num_mtp_layers else None)

    def embed_tokens(self, tokens_BxT: jax.Array) -> jax.Array:
        """int [B, T] -> [B, T, D] in the compute dtype."""
        return jnp.take(self.embed[...], tokens_BxT, axis=0).astype(self.config.compute_dtype)

    def logits(self, h: jax.Array) -> jax.Array:
        """[..., D] after a final norm -> float32 [..., V] (the head shared by the MTP depths)."""
        dt = self.config.compute_dtype
        return jnp.einsum("...D,DV->...V", h.astype(dt), self.head[...].astype(dt),
                          preferred_element_type=jnp.float32)

    def _context(self, tokens_BxT, positions, segment_ids, token_mask, cache: ModelCache | None = None) -> Context:
        b, t = tokens_BxT.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cos, sin = rope_angles(positions, self.config)
        if token_mask is None and segment_ids is not None:
            token_mask = segment_ids > 0
        if cache is None:
            return Context(cos, sin, segment_ids, token_mask)
        return Context(cos, sin, segment_ids, token_mask, positions, cache.page_table)

    def forward(self, tokens_BxT: jax.Array, *, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None, with_mtp: bool = True, cache: ModelCache | None = None,
                token_mask: jax.Array | None = None, indexer_loss: bool = False) -> ModelOutput:
        """Everything training needs from one pass, or one inference step with a `cache`.

        tokens int [B, T]; positions int [B, T] (default 0..T-1; packed rows restart them per
        document); segment_ids int [B, T] (documents of a packed row, 0 = padding) make attention
        document-aware and keep padding out of router statistics; token_mask bool [B, T] (default
        segment_ids > 0) names the tokens that count in router statistics.

        With `cache`, the tokens sit at `positions` (consecutive per row, slot = position), attend
        to the cache slots before them and to each other, and their entries are written; the MTP
        depths are not run (drafting runs them one by one: `mtp_depth`). `segment_ids` must be None.

        `indexer_loss` (a V3.2 model in training, no cache): every layer's MLA also returns its
        lightning indexer's KL to the main attention (model/indexer.py), summed in `indexer_loss`.
        """
        cfg = self.config
        check_tokens(tokens_BxT, cfg.vocab_size)
        if cache is not None and (with_mtp and self.mtp is not None or segment_ids is not None or indexer_loss):
            raise ValueError("forward with a cache takes with_mtp=False, no segment_ids and no indexer_loss")
        if indexer_loss and not cfg.has_indexer:
            raise ValueError("indexer_loss needs a model with the lightning indexer (index_n_heads > 0)")
        ctx = self._context(tokens_BxT, positions, segment_ids, token_mask, cache)
        emb = self.embed_tokens(tokens_BxT)
        dense, moe = (None, None) if cache is None else (cache.dense, cache.moe)
        x, stats = emb, None
        if self.dense_layers is not None:
            x, _, dense = run_stack(self.dense_layers, x, ctx, remat=cfg.remat, cache=dense,
                                    unroll_max_layers=cfg.unroll_max_layers, indexer_loss=indexer_loss)
        if self.moe_layers is not None:
            x, stats, moe = self._moe_stack(x, ctx, moe, indexer_loss)
        if indexer_loss:  # the stacks' third outputs: per-layer KLs, not caches
            kl = sum(jnp.sum(per_layer) for per_layer in (dense, moe) if per_layer is not None)
            return self._outputs(x, emb, ctx, stats, with_mtp, indexer_kl=kl)
        new_cache = None if cache is None else cache._replace(dense=dense, moe=moe)
        return self._outputs(x, emb, ctx, stats, with_mtp, new_cache)

    def _outputs(self, x_BxTxD: jax.Array, emb_BxTxD: jax.Array, ctx: Context, stats: RouterStats | None,
                 with_mtp: bool, cache: ModelCache | None = None, indexer_kl: jax.Array | None = None) -> ModelOutput:
        """The final norm, the main head and (`with_mtp`) the MTP depths after the layer stacks;
        `indexer_kl`: the stacks' summed indexer KL, to which the MTP depths' is added."""
        h = self.norm(x_BxTxD)
        mtp_h = mtp_logits = mtp_stats = None
        if with_mtp and self.mtp is not None:
            mtp_h, mtp_stats, *mtp_kl = run_mtp(self.mtp, h, emb_BxTxD, ctx, remat=self.config.remat,
                                                indexer_loss=indexer_kl is not None)
            mtp_logits = self.logits(mtp_h)
            indexer_kl = indexer_kl + jnp.sum(mtp_kl[0]) if mtp_kl else indexer_kl
        return ModelOutput(self.logits(h), h, stats, mtp_logits, mtp_stats, cache, mtp_h, indexer_kl)

    def _moe_stack(self, x_BxTxD: jax.Array, ctx: Context, cache: LatentCache | None, indexer_loss: bool = False):
        """The MoE layers: in pipeline stages on a mesh with a `pipeline` axis (training), else scanned."""
        cfg = self.config
        mesh = jax.sharding.get_abstract_mesh()  # the context mesh (jax.set_mesh), as in the MoE layer
        if cache is None and pipeline.is_active(mesh):  # layers in stages, microbatches scheduled over them
            if indexer_loss:
                raise ValueError("training the lightning indexer (indexer_loss) runs the MoE stack scanned: "
                                 "use a mesh without a pipeline axis (config.mesh.pipeline=1)")
            x, stats = run_stack_pipelined(self.moe_layers, x_BxTxD, ctx, remat=cfg.remat, mesh=mesh,
                                           microbatches=cfg.pipeline_microbatches, repeats=cfg.pipeline_repeats,
                                           schedule=cfg.pipeline_schedule)
            return x, stats, None
        return run_stack(self.moe_layers, x_BxTxD, ctx, remat=cfg.remat, cache=cache,
                         unroll_max_layers=cfg.unroll_max_layers, indexer_loss=indexer_loss)

    def forward_in_microbatches(self, tokens_BxT: jax.Array, head_fn, extras, *, positions: jax.Array,
                                segment_ids: jax.Array, microbatches: int):
        """The training `forward` (with MTP) with the layers outside the MoE stack run over
        `microbatches` slices of the batch in turn (sharding/pipeline.py: `map_microbatches`): the
        embedding and dense layers before the stack, the final norm, head and MTP after it, each
        slice recomputed in the backward. The stack sees the whole batch (its own microbatches).

        head_fn(out: ModelOutput of one slice, extras of that slice) -> a pytree (e.g. loss sums),
        so the logits of one slice at most are alive. extras: a pytree of [B, ...] leaves.
        Returns (head_fn's outputs stacked [microbatches, ...], the MoE stack's RouterStats or None).
        """
        cfg = self.config
        check_tokens(tokens_BxT, cfg.vocab_size)
        graphdef, state = nnx.split(self)
        leaves, treedef = jax.tree.flatten(state)  # arrays: the slices' functions rebuild the model in their trace
        rebuild = lambda: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))  # noqa: E731

        def before(args):
            model, (tokens, pos, seg) = rebuild(), args
            x = model.embed_tokens(tokens)
            if model.dense_layers is not None:
                x, _, _ = run_stack(model.dense_layers, x, model._context(tokens, pos, seg, None), remat=cfg.remat,
                                    unroll_max_layers=cfg.unroll_max_layers)
            return x

        inputs = (tokens_BxT, positions, segment_ids)
        x = pipeline.merge_microbatches(pipeline.map_microbatches(before, inputs, microbatches))
        stats = None
        if self.moe_layers is not None:
            x, stats, _ = self._moe_stack(x, self._context(*inputs, None), None)

        def after(args):
            model, (tokens, pos, seg, x, extra) = rebuild(), args
            ctx = model._context(tokens, pos, seg, None)
            return head_fn(model._outputs(x, model.embed_tokens(tokens), ctx, None, with_mtp=True), extra)

        return pipeline.map_microbatches(after, (*inputs, x, extras), microbatches), stats

    def mtp_depth(self, depth: int, h_prev_BxTxD: jax.Array, tokens_next_BxT: jax.Array, positions_BxT: jax.Array,
                  cache: ModelCache) -> tuple[jax.Array, ModelCache]:
        """MTP depth `depth` (0-based) over a window: h^{depth} [B, T, D] from h^{depth-1} and the tokens
        one further (t_{i+depth+1} at i), writing its latent entries at `positions` in `cache.mtp`."""
        graphdef, state = nnx.split(self.mtp)
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[depth], state))
        ctx = self._context(tokens_next_BxT, positions_BxT, None, None, cache)
        h, _, entries = layer(h_prev_BxTxD, self.embed_tokens(tokens_next_BxT), ctx, cache.mtp, depth)
        return h, cache._replace(mtp=cache.mtp.write(entries, positions_BxT, depth, cache.page_table))

    def __call__(self, tokens_BxT: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """int [B, T] -> float32 logits [B, T, vocab] of the main head."""
        return self.forward(tokens_BxT, positions=positions, segment_ids=segment_ids, with_mtp=False).logits

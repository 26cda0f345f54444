"""Multi-token prediction module (DeepSeek-V3 section 2.2).

Depth k at position i: h'_i = W_eh [enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)], then one MoE
transformer block, then `norm` (HF `shared_head.norm`); the output head is the main model's.
h^0 is the main model's output after its final norm; h^k is this module's normed output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import params
from dsv3_jax.model.attention import LatentCache
from dsv3_jax.model.block import Block, Context
from dsv3_jax.model.norm import RMSNorm


class MTPLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, pd = cfg.hidden_size, cfg.param_dtype
        self.compute_dtype = cfg.compute_dtype
        self.enorm = RMSNorm(d, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd)
        self.hnorm = RMSNorm(d, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd)
        self.eh_proj = params.normal(rngs, (2 * d, d), (None, "embed"), std=cfg.initializer_range, dtype=pd)
        self.block = Block(cfg, moe=True, rngs=rngs)
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, axis_name="embed", param_dtype=pd)

    def __call__(self, h_prev_BxTxD: jax.Array, emb_next_BxTxD: jax.Array, ctx: Context,
                 cache: LatentCache | None = None, depth=None, *, indexer_loss: bool = False):
        """h^{k-1} [B, T, D] and Emb(t_{i+k}) [B, T, D] -> (h^k [B, T, D], router stats); with this
        depth's latent `cache` (or the stack of depths read at `depth`) also the entries to store at
        `ctx.positions`, with `indexer_loss` the indexer's KL (see `Block`)."""
        dt = self.compute_dtype
        z = jnp.concatenate([self.enorm(emb_next_BxTxD), self.hnorm(h_prev_BxTxD)], axis=-1)
        z = jnp.einsum("BTE,ED->BTD", z.astype(dt), self.eh_proj[...].astype(dt),
                       preferred_element_type=jnp.float32).astype(dt)
        z, *rest = self.block(z, ctx, cache, depth, indexer_loss=indexer_loss)
        return (self.norm(z), *rest)


def shift_left(x_BxTx_: jax.Array, k: int) -> jax.Array:
    """x[:, i + k] at position i, zero-filled past the end."""
    return jnp.pad(x_BxTx_[:, k:], [(0, 0), (0, k)] + [(0, 0)] * (x_BxTx_.ndim - 2))


def run_mtp(layers: MTPLayer, h_BxTxD: jax.Array, emb_BxTxD: jax.Array, ctx: Context, *, remat: bool,
            indexer_loss: bool = False):
    """Runs the stacked MTP depths in sequence. Returns (h^k [M, B, T, D], stats stacked on M), and
    with `indexer_loss` each depth's indexer KL [M] third."""
    depth = layers.eh_proj.shape[0]
    emb_next = jnp.stack([shift_left(emb_BxTxD, k) for k in range(1, depth + 1)])

    constrain = params.layer_constraint(layers)

    def body(h, layer, emb):
        h, *per_depth = constrain(layer)(h, emb, ctx, indexer_loss=indexer_loss)
        return h, (h, *per_depth)

    if remat:
        body = nnx.remat(body)
    _, (hs, *per_depth) = nnx.scan(body, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))(h_BxTxD, layers, emb_next)
    return (hs, *per_depth)

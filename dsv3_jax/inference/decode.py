"""Inference steps over the latent cache, all through the model's own forward (no model math here).

Letters: B batch, W tokens of this step, M MTP depths, D model, V vocab.

`model_step` is a prefill chunk, a decode step or a speculative verify window: the main model over
W tokens at their positions (slot = position), reading the cache before them and writing theirs.
`mtp_draft` runs the MTP depths one after another to draft M tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv3_jax.model import ModelCache, ModelOutput


def model_step(model, cache: ModelCache, tokens_BxW: jax.Array, positions_BxW: jax.Array,
               token_mask_BxW: jax.Array | None = None) -> ModelOutput:
    """Main model over W new tokens; `token_mask` (default all) says which count in router statistics.
    Returns the model's output with logits [B, W, V], hidden [B, W, D] and the updated `cache`."""
    return model.forward(tokens_BxW, positions=positions_BxW, with_mtp=False, cache=cache,
                         token_mask=token_mask_BxW)


def mtp_draft(model, cache: ModelCache, h_BxWxD: jax.Array, next_tokens_BxN: jax.Array, positions_BxW: jax.Array,
              last_B: jax.Array, active_B: jax.Array | None = None) -> tuple[jax.Array, ModelCache]:
    """Runs the MTP depths over a window and drafts one token per depth from window index `last`.

    Depth k (1-based) at window index j reads h^{k-1}_j and the token at position p_j + k, taken from
    `next_tokens` (t_{p_j + 1} at column j, N >= W + M columns: a prefill chunk passes the prompt
    beyond it) with the drafts of shallower depths written in at last + k. Returns (drafts int32
    [B, M], cache); depth k's entries at j > last - k + 1 used drafted tokens (they stay in the
    cache: that can lower acceptance at depth >= 2, never change the verified output).
    """
    num_depths = cache.mtp.latent.shape[0]
    b, w = positions_BxW.shape
    rows, ext, h, drafts = jnp.arange(b), next_tokens_BxN, h_BxWxD, []
    for k in range(num_depths):
        h, cache = model.mtp_depth(k, h, jax.lax.dynamic_slice_in_dim(ext, k, w, axis=1), positions_BxW, cache)
        draft = jnp.argmax(model.logits(h[rows, last_B]), axis=-1).astype(jnp.int32)
        keep = ext[rows, last_B + k + 1]
        ext = ext.at[rows, last_B + k + 1].set(draft if active_B is None else jnp.where(active_B, draft, keep))
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), cache

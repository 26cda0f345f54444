"""One model step over the latent cache: prefill (the model's own MLA) or absorbed decode.

Letters: B batch, W new tokens this step, S cache slots, D model, H heads, C latent (kv_lora_rank),
N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim (in einsums; `vocab` elsewhere), L layers.

Absorbed MLA (DeepSeek-V3 section 2.1.1): with k_nope[h] = W_uk[h] c and v[h] = W_uv[h] c,
  q_nope[h] . k_nope[h] = (W_uk[h]^T q_nope[h]) . c = q_lat[h] . c
  sum_s p_s v_s[h] = W_uv[h] (sum_s p_s c_s) = W_uv[h] o_lat[h]
so each step reads only the cached c [S, C] and k_pe [S, R], never per-head keys or values.

Every function here is pure in (model state, cache, tokens): `generate` merges the state inside jit.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.inference.cache import KVCache, StackCache, decode_latent, encode
from dsv3_jax.model.attention import MLA
from dsv3_jax.model.block import Block
from dsv3_jax.model.moe import MoE, RouterStats
from dsv3_jax.model.rope import apply_rope, rope_angles

# Traces per step kind; tests read it to prove one compiled decode step serves every token.
TRACE_COUNTS: collections.Counter = collections.Counter()


class StepOutput(NamedTuple):
    logits: jax.Array  # float32 [B, W, vocab]
    hidden: jax.Array  # [B, W, D] after the final norm (the MTP modules' h^0)
    router_stats: RouterStats | None  # MoE layers, stacked [L_moe, ...]
    cache: KVCache


def _mm(eq: str, x: jax.Array, w: jax.Array, dt) -> jax.Array:
    return jnp.einsum(eq, x.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)


def absorbed_attention(attn: MLA, q_BxWxHxK: jax.Array, cos, sin, latent_BxSxC: jax.Array,
                       k_pe_BxSxR: jax.Array, positions_BxW: jax.Array) -> jax.Array:
    """Queries at `positions` attend to cached slots s <= their position. Returns [B, W, D].

    q is `attn.query(x)` (rope part unrotated); the cache already holds this step's entries.
    """
    cfg, dt = attn.cfg, attn.cfg.compute_dtype
    n = cfg.qk_nope_head_dim
    q_nope, q_pe = jnp.split(q_BxWxHxK, [n], axis=-1)
    q_pe = apply_rope(q_pe, cos, sin, interleave=cfg.rope_interleave)
    w_uk, w_uv = jnp.split(attn.wkv_b[...], [n], axis=-1)  # [C, H, N], [C, H, V]
    q_lat = _mm("BWHN,CHN->BWHC", q_nope, w_uk, dt)
    if cfg.attention_impl == "pallas" and q_lat.shape[1] == 1:
        import pallas_kernels  # kernels have no model knowledge; imported on demand

        o_lat = pallas_kernels.mla_decode(q_lat[:, 0], q_pe[:, 0].astype(jnp.float32), latent_BxSxC, k_pe_BxSxR,
                                          positions_BxW[:, 0] + 1, softmax_scale=cfg.softmax_scale)[:, None]
    else:  # also the multi-token verify step of speculative decoding (causal among the W queries)
        o_lat = _attend_latent(q_lat, q_pe, latent_BxSxC, k_pe_BxSxR, positions_BxW, cfg.softmax_scale, dt)
    out = _mm("BWHC,CHV->BWHV", o_lat, w_uv, dt).astype(dt)
    return _mm("BWHV,HVD->BWD", out, attn.wo[...], dt).astype(dt)


def _attend_latent(q_lat_BxWxHxC, q_pe_BxWxHxR, latent_BxSxC, k_pe_BxSxR, positions_BxW, scale, dt):
    """Softmax over cached slots in fp32 -> o_lat [B, W, H, C] float32."""
    scores = (_mm("BWHC,BSC->BHWS", q_lat_BxWxHxC, latent_BxSxC, dt)
              + _mm("BWHR,BSR->BHWS", q_pe_BxWxHxR, k_pe_BxSxR, dt)) * scale
    slots = jnp.arange(latent_BxSxC.shape[1])
    visible = slots[None, None, None, :] <= positions_BxW[:, None, :, None]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return _mm("BHWS,BSC->BWHC", probs, latent_BxSxC, dt)


def _write(stack: StackCache, layer, entries, positions_BxW: jax.Array) -> StackCache:
    rows = jnp.arange(positions_BxW.shape[0])[:, None]
    return StackCache(*(None if arr is None else arr.at[layer, rows, positions_BxW].set(new)
                        for arr, new in zip(stack, entries)))


def block_step(block: Block, x_BxWxD, cos, sin, stack: StackCache, layer, positions_BxW, *,
               prefill: bool, cache_dtype: str, token_mask_BxW=None):
    """One pre-norm block that also writes its cache entries. Returns (x, stack, router stats | None).

    prefill: the window starts at slot 0, so the model's own (naive, causal) MLA computes the
    attention exactly as the training forward does; otherwise absorbed attention over the cache.
    """
    attn, dt = block.attn, block.attn.cfg.compute_dtype
    h = block.attn_norm(x_BxWxD)
    stack = _write(stack, layer, encode(*attn.latent(h, cos, sin), cache_dtype), positions_BxW)
    if prefill:
        a = attn(h, cos, sin)
    else:
        scale = None if stack.latent_scale is None else stack.latent_scale[layer]
        latent = decode_latent(stack.latent[layer], scale, dt)
        a = absorbed_attention(attn, attn.query(h), cos, sin, latent, stack.k_pe[layer].astype(dt), positions_BxW)
    x = x_BxWxD + a
    if isinstance(block.ffn, MoE):
        y, stats = block.ffn(block.ffn_norm(x), token_mask_BxW)
    else:
        y, stats = block.ffn(block.ffn_norm(x)), None
    return x + y, stack, stats


def run_stack(blocks: Block, stack: StackCache, x_BxWxD, cos, sin, positions_BxW, **kw):
    """Scans the layer-stacked blocks with the whole stack cache in the carry (in-place writes)."""
    graphdef, state = nnx.split(blocks)
    num_layers = stack.latent.shape[0]

    def body(carry, xs):
        x, cache = carry
        layer, layer_state = xs
        x, cache, stats = block_step(nnx.merge(graphdef, layer_state), x, cos, sin, cache, layer, positions_BxW,
                                     **kw)
        return (x, cache), stats

    (x, stack), stats = jax.lax.scan(body, (x_BxWxD, stack), (jnp.arange(num_layers), state))
    return x, stack, stats


def embed(model, tokens_BxW: jax.Array) -> jax.Array:
    return jnp.take(model.embed[...], tokens_BxW, axis=0).astype(model.config.compute_dtype)


def logits(model, h_BxWxD: jax.Array) -> jax.Array:
    return _mm("BWD,DV->BWV", h_BxWxD, model.head[...], model.config.compute_dtype)


def model_step(model, cache: KVCache, tokens_BxW: jax.Array, positions_BxW: jax.Array, *, prefill: bool,
               cache_dtype: str, token_mask_BxW: jax.Array | None = None) -> StepOutput:
    """Main model over W new tokens at `positions` (slot = position), reading and writing the cache."""
    cos, sin = rope_angles(positions_BxW, model.config)
    kw = dict(prefill=prefill, cache_dtype=cache_dtype, token_mask_BxW=token_mask_BxW)
    x = embed(model, tokens_BxW)
    dense, moe, stats = cache.dense, cache.moe, None
    if model.dense_layers is not None:
        x, dense, _ = run_stack(model.dense_layers, dense, x, cos, sin, positions_BxW, **kw)
    if model.moe_layers is not None:
        x, moe, stats = run_stack(model.moe_layers, moe, x, cos, sin, positions_BxW, **kw)
    h = model.norm(x)
    return StepOutput(logits(model, h), h, stats, cache._replace(dense=dense, moe=moe))


def mtp_draft(model, cache: KVCache, h_BxWxD: jax.Array, next_tokens_BxW: jax.Array, positions_BxW: jax.Array,
              last_B: jax.Array, *, prefill: bool, cache_dtype: str) -> tuple[jax.Array, KVCache]:
    """Runs the MTP depths over a window and drafts one token per depth from window index `last`.

    Depth k (1-based) at window index j reads h^{k-1}_j and the token at position p_j + k, taken from
    `next_tokens` (t_{p_j + 1}) extended by the drafts of shallower depths. Returns (drafts int32
    [B, M], cache); depth k's entries at j > last - k + 1 used drafted tokens (they stay in the
    cache: that can lower acceptance at depth >= 2, never change the verified output).
    """
    layers, num_depths = model.mtp, cache.mtp.latent.shape[0]
    graphdef, state = nnx.split(layers)
    b, w = next_tokens_BxW.shape
    rows = jnp.arange(b)
    ext = jnp.concatenate([next_tokens_BxW, jnp.zeros((b, num_depths), jnp.int32)], axis=1)
    cos, sin = rope_angles(positions_BxW, model.config)
    stack, h, drafts, dt = cache.mtp, h_BxWxD, [], model.config.compute_dtype
    for k in range(num_depths):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k], state))
        emb = embed(model, jax.lax.dynamic_slice_in_dim(ext, k, w, axis=1))
        z = jnp.concatenate([layer.enorm(emb), layer.hnorm(h)], axis=-1)
        z = _mm("BWE,ED->BWD", z, layer.eh_proj[...], dt).astype(dt)
        z, stack, _ = block_step(layer.block, z, cos, sin, stack, k, positions_BxW, prefill=prefill,
                                 cache_dtype=cache_dtype)
        h = layer.norm(z)
        draft = jnp.argmax(logits(model, h[rows, last_B][:, None])[:, 0], axis=-1).astype(jnp.int32)
        ext = ext.at[rows, last_B + k + 1].set(draft)
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), cache._replace(mtp=stack)

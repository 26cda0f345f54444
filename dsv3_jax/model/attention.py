"""Multi-head Latent Attention (training / prefill form).

Letters: B batch, T length, D model, H heads, Q q_lora_rank, C kv_lora_rank (latent),
N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim, K = N + R.

c_q = RMSNorm(x W_qa); q = c_q W_qb  -> [H, N | R]
[c_kv | k_pe] = x W_kva; c_kv = RMSNorm(c_kv); k_pe = rope(k_pe), one head shared by all heads
[k_nope | v] = c_kv W_kvb per head; scores = (q_nope.k_nope + q_pe.k_pe) * softmax_scale
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import params
from dsv3_jax.model.norm import RMSNorm
from dsv3_jax.model.rope import apply_rope
from dsv3_jax.ops.attention import attention as xla_attention
from dsv3_jax.ops.linear import project


def _attention_fn(impl: str):
    if impl == "pallas":
        import pallas_kernels  # the kernels package has no model knowledge; imported on demand

        return pallas_kernels.mla_prefill
    return xla_attention


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, std, pd = cfg.hidden_size, cfg.num_heads, cfg.initializer_range, cfg.param_dtype
        if cfg.q_lora_rank is None:
            self.wq = params.normal(rngs, (d, h, cfg.qk_head_dim), ("embed", "heads", "head_dim"), std=std, dtype=pd)
        else:
            self.wq_a = params.normal(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), std=std, dtype=pd)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps, axis_name="q_lora", param_dtype=pd)
            self.wq_b = params.normal(rngs, (cfg.q_lora_rank, h, cfg.qk_head_dim), ("q_lora", "heads", "head_dim"),
                                      std=std, dtype=pd)
        self.wkv_a = params.normal(rngs, (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), ("embed", "kv_lora"),
                                   std=std, dtype=pd)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_norm_eps, axis_name="kv_lora", param_dtype=pd)
        self.wkv_b = params.normal(rngs, (cfg.kv_lora_rank, h, cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   ("kv_lora", "heads", "head_dim"), std=std, dtype=pd)
        self.wo = params.normal(rngs, (h, cfg.v_head_dim, d), ("heads", "head_dim", "embed"), std=std, dtype=pd)

    def _mm(self, eq: str, x: jax.Array, w: nnx.Param) -> jax.Array:
        """x's trailing axes contracted with w's leading ones, as the einsum `eq` spells out."""
        lhs, out = eq.split("->")
        x_axes, w_axes = lhs.split(",")
        contract = len(set(x_axes) & set(w_axes) - set(out))
        return project(x, w[...], contract=contract, compute_dtype=self.cfg.compute_dtype, fp8=self.cfg.fp8_matmul)

    def query(self, x_BxTxD: jax.Array) -> jax.Array:
        """[B, T, H, N + R] (rope part not yet rotated)."""
        if self.cfg.q_lora_rank is None:
            return self._mm("BTD,DHK->BTHK", x_BxTxD, self.wq)
        c_q = self.q_norm(self._mm("BTD,DQ->BTQ", x_BxTxD, self.wq_a))
        return self._mm("BTQ,QHK->BTHK", c_q, self.wq_b)

    def latent(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What the decode cache stores: normalised latent [B, T, C] and roped key [B, T, R]."""
        kv_a = self._mm("BTD,DC->BTC", x_BxTxD, self.wkv_a)
        c_kv, k_pe = jnp.split(kv_a, [self.cfg.kv_lora_rank], axis=-1)
        return self.kv_norm(c_kv), apply_rope(k_pe, cos, sin, interleave=self.cfg.rope_interleave)

    def __call__(self, x_BxTxD: jax.Array, cos: jax.Array, sin: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """x [B, T, D], cos/sin [B, T, R/2], segment_ids [B, T] or None -> [B, T, D]."""
        cfg = self.cfg
        q_nope, q_pe = jnp.split(self.query(x_BxTxD), [cfg.qk_nope_head_dim], axis=-1)
        q_pe = apply_rope(q_pe, cos, sin, interleave=cfg.rope_interleave)
        c_kv, k_pe = self.latent(x_BxTxD, cos, sin)
        k_nope, v = jnp.split(self._mm("BSC,CHK->BSHK", c_kv, self.wkv_b), [cfg.qk_nope_head_dim], axis=-1)
        k_pe_BxSxHxR = jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], cfg.qk_rope_head_dim))
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        k = jnp.concatenate([k_nope, k_pe_BxSxHxR], axis=-1)
        out = _attention_fn(cfg.attention_impl)(q, k, v, softmax_scale=cfg.softmax_scale, segment_ids=segment_ids)
        return self._mm("BTHV,HVD->BTD", out, self.wo)

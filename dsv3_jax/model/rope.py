"""Rotary position embedding with YaRN frequency blending (DeepSeek-V3's decoupled rope key).

Layout: with `interleave` the rotated pairs are adjacent, (x0, x1), (x2, x3), ... (the DeepSeek
checkpoint layout); otherwise the halves (x_i, x_{i+R/2}) are paired (rotate_half). Both return
the rotated vector as [first-of-pair | second-of-pair] halves; scores q_pe . k_pe do not depend on
the order as long as queries and keys share it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.config import ModelConfig, YarnConfig


def _yarn_correction_range(yarn: YarnConfig, dim: int, theta: float) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        ctx = yarn.original_max_position_embeddings
        return dim * math.log(ctx / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[R/2] float32 inverse frequencies theta^(-2i/R), YaRN-blended when `cfg.yarn` is set."""
    dim = cfg.qk_rope_head_dim
    pos_freqs = np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolated = (1.0 / pos_freqs).astype(np.float32)
    if cfg.yarn is None:
        return extrapolated
    interpolated = (1.0 / (np.float32(cfg.yarn.factor) * pos_freqs)).astype(np.float32)
    low, high = _yarn_correction_range(cfg.yarn, dim, cfg.rope_theta)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep_original = (1 - ramp).astype(np.float32)  # 1 on high-frequency dims, 0 on low
    return (interpolated * (1 - keep_original) + extrapolated * keep_original).astype(np.float32)


def attention_factor(cfg: ModelConfig) -> float:
    """YaRN's scale on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    yarn = cfg.yarn
    if yarn is None:
        return 1.0
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if yarn.mscale and yarn.mscale_all_dim:
        return mscale(yarn.factor, yarn.mscale) / mscale(yarn.factor, yarn.mscale_all_dim)
    return mscale(yarn.factor)


def rope_angles(positions_BxT: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """positions int [B, T] -> (cos, sin) float32 [B, T, R/2], scaled by the YaRN attention factor."""
    freqs = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_frequencies(cfg))
    scale = attention_factor(cfg)
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleave: bool) -> jax.Array:
    """x [B, T, (H,) R] with cos/sin [B, T, R/2] -> rotated x, same shape and dtype."""
    if x.ndim == 4:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    if interleave:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    else:
        x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

"""RMSNorm, computed in fp32 whatever the activation dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.model import params


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, axis_name: str, param_dtype):
        self.eps = eps
        self.weight = params.ones((dim,), (axis_name,), dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> same shape and dtype; y = w * x / sqrt(mean(x^2) + eps)."""
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)

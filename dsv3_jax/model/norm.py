"""RMSNorm, computed in fp32 whatever the activation dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P



class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, axis_name: str, param_dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> same shape and dtype; y = w * x / sqrt(mean(x^2) + eps)."""
        x32 = _features_whole(x.astype(jnp.float32))
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)


def _features_whole(x: jax.Array) -> jax.Array:
    """x with its feature axis unsplit on the context mesh (jax.set_mesh), the other axes as they are.

    With `fsdp` rules the norm's weight (and the latents q_lora / kv_lora) are split over features,
    and the compiler would then sum x^2 per shard and add the partial sums: one fp32 rounding away
    from one device's sum. Harmless in bf16, but an FP8 forward quantises the next matmul's input to
    e4m3 (3 mantissa bits): that rounding flips an element now and then, and the logits move by
    ~1e-2 (tests/checkpoint/_quant_mesh.py). Summed whole, the mesh gives one device's norm."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:  # no mesh, or inside shard_map: the block is local already
        return x
    return jax.lax.with_sharding_constraint(x, P(*([P.UNCONSTRAINED] * (x.ndim - 1)), None))


class LayerNorm(nnx.Module):
    """LayerNorm with gain and bias over the last axis, in fp32 (the lightning indexer's k_norm)."""

    def __init__(self, dim: int, *, eps: float, param_dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(None,))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=(None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> same shape and dtype; y = w * (x - mean) / sqrt(var + eps) + b."""
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y + self.bias[...].astype(jnp.float32)).astype(x.dtype)

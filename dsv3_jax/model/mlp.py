"""SwiGLU feed-forward: w2(silu(x w1) * x w3). Dense layers and the shared expert(s)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.model import params


class MLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, std: float, param_dtype, compute_dtype, rngs: nnx.Rngs):
        self.compute_dtype = compute_dtype
        self.w1 = params.normal(rngs, (dim, hidden), ("embed", "mlp"), std=std, dtype=param_dtype)
        self.w3 = params.normal(rngs, (dim, hidden), ("embed", "mlp"), std=std, dtype=param_dtype)
        self.w2 = params.normal(rngs, (hidden, dim), ("mlp", "embed"), std=std, dtype=param_dtype)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x = x_BxTxD.astype(self.compute_dtype)

        def mm(eq, lhs, w):
            return jnp.einsum(eq, lhs, w[...].astype(self.compute_dtype),
                              preferred_element_type=jnp.float32).astype(self.compute_dtype)

        gate = mm("BTD,DF->BTF", x, self.w1)
        h = jax.nn.silu(gate.astype(jnp.float32)).astype(self.compute_dtype) * mm("BTD,DF->BTF", x, self.w3)
        return mm("BTF,FD->BTD", h, self.w2)

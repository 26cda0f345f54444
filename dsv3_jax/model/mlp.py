"""SwiGLU feed-forward: w2(silu(x w1) * x w3). Dense layers and the shared expert(s)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.model import lora, params
from dsv3_jax.ops.linear import project


class MLP(nnx.Module):
    LORA_TARGETS = {"w1": 1, "w3": 1, "w2": 1}  # weight: contracted axes

    def __init__(self, dim: int, hidden: int, *, std: float, param_dtype, compute_dtype, rngs: nnx.Rngs,
                 fp8: bool = False):
        self.compute_dtype, self.fp8 = compute_dtype, fp8
        self.w1 = params.normal(rngs, (dim, hidden), ("embed", "mlp"), std=std, dtype=param_dtype)
        self.w3 = params.normal(rngs, (dim, hidden), ("embed", "mlp"), std=std, dtype=param_dtype)
        self.w2 = params.normal(rngs, (hidden, dim), ("mlp", "embed"), std=std, dtype=param_dtype)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        def mm(lhs, name):  # BTD,DF->BTF and BTF,FD->BTD, plus the weight's LoRA adapter if any
            return project(lhs, getattr(self, name)[...], contract=1, compute_dtype=self.compute_dtype, fp8=self.fp8,
                           lora=lora.pair(self, name))

        h = jax.nn.silu(mm(x_BxTxD, "w1").astype(jnp.float32)).astype(self.compute_dtype) * mm(x_BxTxD, "w3")
        return mm(h, "w2")

"""Auxiliary-loss-free load balancing (DeepSeek-V3 section 2.1.2) and the load metric MaxVio.

After every step each MoE layer's router bias moves by gamma against its expert's load:

    b_i <- b_i + gamma * sign(mean_j c_j - c_i)

with c the tokens routed to each expert over the whole global batch. The bias lives in
`RouterBias` variables, outside the optimizer: it is never weight-decayed, never clipped, and it
only steers selection (the router stop-gradients it and gates with the unbiased scores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def bias_update(bias_LxE: jax.Array, counts_LxE: jax.Array, gamma: float) -> jax.Array:
    """One sign-rule step for a stack of L layers; overloaded experts go down, idle ones up."""
    mean_Lx1 = jnp.mean(counts_LxE, axis=-1, keepdims=True)
    return bias_LxE + gamma * jnp.sign(mean_Lx1 - counts_LxE).astype(bias_LxE.dtype)


def update_router_biases(biases: dict, main_counts_LxE: jax.Array | None,
                         mtp_counts_MxE: jax.Array | None, gamma: float) -> dict:
    """Applies `bias_update` to the main and MTP router biases of a model's pure-dict bias tree.

    Args:
      biases: pure dict of `RouterBias` values (`nnx.to_pure_dict(nnx.state(model, RouterBias))`),
        holding `moe_layers.ffn.gate.bias` [L_moe, E] and/or `mtp.block.ffn.gate.bias` [M, E].
      main_counts_LxE, mtp_counts_MxE: the step's expert counts (`RouterStats.expert_counts`) of
        the main MoE layers and the MTP layers; None where the model has none.
    """
    new = jax.tree.map(lambda x: x, biases)  # a fresh container; leaves are replaced below
    if main_counts_LxE is not None:
        gate = new["moe_layers"]["ffn"]["gate"]
        gate["bias"] = bias_update(gate["bias"], main_counts_LxE, gamma)
    if mtp_counts_MxE is not None:
        gate = new["mtp"]["block"]["ffn"]["gate"]
        gate["bias"] = bias_update(gate["bias"], mtp_counts_MxE, gamma)
    return new


def max_violation(counts_LxE) -> jax.Array:
    """MaxVio per layer: max_i load_i / mean load - 1 (0 when perfectly balanced)."""
    counts_LxE = jnp.asarray(counts_LxE, jnp.float32)
    mean = jnp.mean(counts_LxE, axis=-1)
    return jnp.max(counts_LxE, axis=-1) / jnp.maximum(mean, 1e-9) - 1.0

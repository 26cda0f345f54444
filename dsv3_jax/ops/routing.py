"""DeepSeek-V3 router: sigmoid scores, bias-corrected group-limited top-k, normalised gates.

Letters: N tokens, E routed experts, G groups, K experts per token, R replicas of an expert at most.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    weights_NxK: jax.Array  # float32 gates: unbiased scores at the chosen experts, normalised, scaled
    experts_NxK: jax.Array  # int32 expert ids
    scores_NxE: jax.Array  # float32 sigmoid scores (unbiased), for the balance loss


def route(logits_NxE: jax.Array, bias_E: jax.Array, *, top_k: int, num_groups: int, groups_kept: int,
          routed_scale: float, normalize: bool) -> Routing:
    """Selects experts with the biased scores s + b and gates them with the unbiased s.

    Group score = sum of the top-2 biased scores of the group; the best `groups_kept` groups stay,
    the rest get -inf (biased scores can be negative, so 0 would not exclude them).
    """
    scores = jax.nn.sigmoid(logits_NxE.astype(jnp.float32))
    biased = scores + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    if num_groups > 1 and groups_kept < num_groups:
        n, e = biased.shape
        grouped_NxGxM = biased.reshape(n, num_groups, e // num_groups)
        group_score_NxG = jnp.sum(jax.lax.top_k(grouped_NxGxM, 2)[0], axis=-1)
        _, kept_groups = jax.lax.top_k(group_score_NxG, groups_kept)
        keep_NxG = jnp.zeros((n, num_groups), bool).at[jnp.arange(n)[:, None], kept_groups].set(True)
        biased = jnp.where(keep_NxG[:, :, None], grouped_NxGxM, -jnp.inf).reshape(n, e)
    _, experts = jax.lax.top_k(biased, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return Routing(weights * routed_scale, experts.astype(jnp.int32), scores)


def to_replicas(experts_NxK: jax.Array, replicas_ExR: jax.Array) -> jax.Array:
    """Logical expert ids -> physical ones: token n sends its row for expert e to replica
    n mod (e's replica count), so an expert's tokens take its replicas in turn, the same on every
    call. `replicas_ExR`: an EPLB placement's map (sharding/eplb.py), -1 past an expert's replicas."""
    count_NxK = jnp.sum(replicas_ExR >= 0, axis=-1)[experts_NxK]
    token_Nx1 = jnp.arange(experts_NxK.shape[0])[:, None]
    return replicas_ExR[experts_NxK, token_Nx1 % count_NxK].astype(jnp.int32)


def expert_counts(experts_NxK: jax.Array, num_experts: int, token_mask_N: jax.Array | None = None) -> jax.Array:
    """float32 [E]: how many (valid) tokens chose each expert."""
    w = jnp.ones(experts_NxK.shape, jnp.float32)
    if token_mask_N is not None:
        w = w * token_mask_N.astype(jnp.float32)[:, None]
    return jnp.zeros((num_experts,), jnp.float32).at[experts_NxK.reshape(-1)].add(w.reshape(-1))


def sequence_balance_loss(routing: Routing, batch: int, token_mask_BxT: jax.Array | None = None) -> jax.Array:
    """Complementary sequence-wise balance loss (DeepSeek-V3 eq. 17-20), averaged over sequences.

    L = sum_i f_i P_i with f_i = E / (K T) * count_i and P_i = mean_t s_i,t / sum_j s_j,t,
    both per sequence. The weight alpha is applied by the trainer.
    """
    n, e = routing.scores_NxE.shape
    k = routing.experts_NxK.shape[-1]
    mask = (jnp.ones((batch, n // batch), jnp.float32) if token_mask_BxT is None
            else token_mask_BxT.astype(jnp.float32))
    tokens_B = jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    experts_BxTK = routing.experts_NxK.reshape(batch, -1)
    mask_BxTK = jnp.repeat(mask, k, axis=1)
    counts_BxE = jnp.zeros((batch, e), jnp.float32).at[jnp.arange(batch)[:, None], experts_BxTK].add(mask_BxTK)
    f_BxE = counts_BxE * (e / k) / tokens_B[:, None]
    normalized = routing.scores_NxE / jnp.sum(routing.scores_NxE, axis=-1, keepdims=True)
    p_BxE = jnp.sum(normalized.reshape(batch, -1, e) * mask[..., None], axis=1) / tokens_B[:, None]
    return jnp.mean(jnp.sum(f_BxE * p_BxE, axis=-1))

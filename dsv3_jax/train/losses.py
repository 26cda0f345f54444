"""Training losses (DeepSeek-V3 sections 2.2 and 2.1.2): next-token CE, MTP CE, balance loss.

Batches come from `dsv3_jax.data` as packed rows of T + 1 tokens; targets and masks are derived
here from the segment ids, so a token never predicts one from another document. Chat batches also
carry `loss_mask` (1 on assistant tokens): then only assistant tokens are targets, in the main loss,
the MTP losses and the eval loss alike, each a mean over the targets it counts.

Letters: B batch, T positions (inputs), V vocab, M MTP depths, L MoE layers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv3_jax.ops.cross_entropy import token_nll


class Losses(NamedTuple):
    total: jax.Array  # [] lm + mtp_weight * mtp + balance_weight * balance
    lm: jax.Array  # [] next-token cross-entropy, mean over valid tokens
    mtp: jax.Array  # [] MTP cross-entropy averaged over depths (0 without MTP)
    balance: jax.Array  # [] sequence-wise balance loss averaged over MoE layers, before alpha


def inputs_and_targets(batch: dict, depth: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inputs and the targets `depth + 1` tokens ahead from packed rows of T + 1 tokens.

    Args:
      batch: int32 `tokens`, `segment_ids` [B, T + 1]; optional `loss_mask` [B, T + 1] (chat data).
      depth: 0 for the main head; k for MTP depth k (target t_{i+k+1}).
    Returns:
      inputs [B, T], targets [B, T], mask [B, T] bool: the target exists, is not padding, lies in
      the input token's document and, with `loss_mask`, is an assistant token.
    """
    tokens, seg = batch["tokens"], batch["segment_ids"]
    t = tokens.shape[1] - 1
    shift = depth + 1
    pad = ((0, 0), (0, shift - 1))
    targets = jnp.pad(tokens[:, shift:], pad)
    seg_target = jnp.pad(seg[:, shift:], pad)  # 0 past the end: never valid
    mask = (seg_target == seg[:, :t]) & (seg_target > 0)
    if "loss_mask" in batch:
        mask &= jnp.pad(batch["loss_mask"][:, shift:], pad) > 0
    return tokens[:, :t], targets, mask


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array, mask_BxT: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """Returns (summed -log p(target) over masked tokens, number of masked tokens), fp32."""
    nll = token_nll(logits_BxTxV, targets_BxT)
    m = mask_BxT.astype(jnp.float32)
    return jnp.sum(nll * m), jnp.sum(m)


def mean_cross_entropy(logits_BxTxV, targets_BxT, mask_BxT) -> jax.Array:
    total, count = cross_entropy(logits_BxTxV, targets_BxT, mask_BxT)
    return total / jnp.maximum(count, 1.0)


def mtp_loss(mtp_logits_MxBxTxV: jax.Array, batch: dict) -> jax.Array:
    """L_MTP = (1/M) sum_k CE_k (paper eq. 25 before lambda); depth k predicts t_{i+k+1}."""
    depths = mtp_logits_MxBxTxV.shape[0]
    per_depth = []
    for k in range(1, depths + 1):
        _, targets, mask = inputs_and_targets(batch, depth=k)
        per_depth.append(mean_cross_entropy(mtp_logits_MxBxTxV[k - 1], targets, mask))
    return jnp.mean(jnp.stack(per_depth))


def training_losses(output, batch: dict, *, mtp_weight: float, balance_weight: float) -> Losses:
    """Combines a `ModelOutput` into the DeepSeek-V3 training objective.

    The balance loss is averaged over all MoE layers, main and MTP alike, so alpha does not
    scale with depth.
    """
    _, targets, mask = inputs_and_targets(batch)
    lm = mean_cross_entropy(output.logits, targets, mask)
    mtp = jnp.zeros((), jnp.float32) if output.mtp_logits is None else mtp_loss(output.mtp_logits, batch)
    return objective(lm, mtp, (output.router_stats, output.mtp_router_stats), mtp_weight=mtp_weight,
                     balance_weight=balance_weight)


def objective(lm: jax.Array, mtp: jax.Array, router_stats, *, mtp_weight: float, balance_weight: float) -> Losses:
    """lm + mtp_weight * mtp + balance_weight * the balance loss averaged over the MoE layers of
    `router_stats` (RouterStats or None each, leaves [L, ...])."""
    per_layer = [s.balance_loss for s in router_stats if s is not None]
    balance = jnp.mean(jnp.concatenate(per_layer)) if per_layer else jnp.zeros((), jnp.float32)
    return Losses(lm + mtp_weight * mtp + balance_weight * balance, lm, mtp, balance)

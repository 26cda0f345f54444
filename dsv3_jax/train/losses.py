"""Training losses (DeepSeek-V3 sections 2.2 and 2.1.2): next-token CE, MTP CE, balance loss, and
for a V3.2 model whose lightning indexer trains, the indexer's KL to the main attention
(dsv3_jax/model/indexer.py; DeepSeek-V3.2's continued pre-training).

Batches come from `dsv3_jax.data` as packed rows of T + 1 tokens; targets and masks are derived
here from the segment ids, so a token never predicts one from another document. Chat batches also
carry `loss_mask` (1 on assistant tokens): then only assistant tokens are targets, in the main loss,
the MTP losses and the eval loss alike, each a mean over the targets it counts.

With a `Head` the losses apply the output head themselves to the hidden states (`ModelOutput.hidden`,
`mtp_hidden`), fused with the cross-entropy a chunk of tokens at a time (`head_loss_impl`), so a
train step never holds the [B, T, V] logits; without one they read `ModelOutput.logits`.

Letters: B batch, T positions (inputs), D model, V vocab, M MTP depths, L MoE layers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv3_jax.ops.cross_entropy import token_nll
from dsv3_jax.ops.head_loss import head_nll

# Tokens per chunk of the chunked head loss (chosen in docs/benchmarks.md); [256, V] fp32 logits are
# 132 MB at the 671B vocabulary.
HEAD_CHUNK_TOKENS = 256


class Losses(NamedTuple):
    total: jax.Array  # [] lm + mtp_weight * mtp + balance_weight * balance (+ indexer_weight * indexer)
    lm: jax.Array  # [] next-token cross-entropy, mean over valid tokens
    mtp: jax.Array  # [] MTP cross-entropy averaged over depths (0 without MTP)
    balance: jax.Array  # [] sequence-wise balance loss averaged over MoE layers, before alpha
    indexer: jax.Array | float = 0.0  # [] the indexers' KL summed over layers, before its weight (0: not trained)


class Head(NamedTuple):
    """The output head as the losses apply it (the model's `logits` without the matmul's output)."""

    weight_DxV: jax.Array
    compute_dtype: str  # the matmul's inputs; fp32 accumulation
    impl: str  # chunked | full (ModelConfig.head_loss_impl)

    @classmethod
    def of(cls, model) -> "Head":
        return cls(model.head[...], model.config.compute_dtype, model.config.head_loss_impl)


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


def head_cross_entropy(head: Head, h_BxTxD: jax.Array, targets_BxT: jax.Array, mask_BxT: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy` of the logits h W without forming them when `head.impl` is chunked."""
    m = mask_BxT.astype(jnp.float32)
    if head.impl == "full":
        logits = jnp.einsum("BTD,DV->BTV", h_BxTxD.astype(head.compute_dtype),
                            head.weight_DxV.astype(head.compute_dtype), preferred_element_type=jnp.float32)
        return cross_entropy(logits, targets_BxT, mask_BxT)
    chunk = max(1, HEAD_CHUNK_TOKENS // h_BxTxD.shape[0])  # positions per chunk
    return head_nll(h_BxTxD, head.weight_DxV, targets_BxT, m, chunk=chunk, compute_dtype=head.compute_dtype), jnp.sum(m)


def nll_sums(main, depths, batch: dict, head: Head | None = None) -> list[tuple[jax.Array, jax.Array]]:
    """(summed -log p(target), target count) of the main head, then of each MTP depth k = 1 .. M
    (target t_{i+k+1}). `main` [B, T, V] and `depths` [M, B, T, V] (None without MTP) are logits;
    with `head`, the hidden states [B, T, D] / [M, B, T, D] it is applied to."""
    ce = cross_entropy if head is None else functools.partial(head_cross_entropy, head)
    num_depths = 0 if depths is None else depths.shape[0]
    return [ce(main if k == 0 else depths[k - 1], *inputs_and_targets(batch, depth=k)[1:])
            for k in range(num_depths + 1)]


def training_losses(output, batch: dict, *, mtp_weight: float, balance_weight: float,
                    head: Head | None = None, indexer_weight: float = 0.0) -> Losses:
    """Combines a `ModelOutput` into the DeepSeek-V3 training objective, plus `indexer_weight` times
    `output.indexer_loss` when the forward computed it.

    With `head` (`Head.of(model)`) the cross-entropies apply it to `output.hidden` and
    `output.mtp_hidden` (the logits are then unused and a jitted step never computes them).
    """
    main, depths = (output.logits, output.mtp_logits) if head is None else (output.hidden, output.mtp_hidden)
    parts = objective(nll_sums(main, depths, batch, head), (output.router_stats, output.mtp_router_stats),
                      mtp_weight=mtp_weight, balance_weight=balance_weight)
    if output.indexer_loss is None:
        return parts
    return parts._replace(total=parts.total + indexer_weight * output.indexer_loss, indexer=output.indexer_loss)


def objective(sums: list[tuple[jax.Array, jax.Array]], router_stats, *, mtp_weight: float,
              balance_weight: float) -> Losses:
    """lm + mtp_weight * L_MTP + balance_weight * balance from `nll_sums` (each summed over any
    leading microbatch axis first): lm is the main head's mean NLL, L_MTP = (1/M) sum_k CE_k (paper
    eq. 25 before lambda), and the balance loss is averaged over the MoE layers of `router_stats`
    (RouterStats or None each, leaves [L, ...]), main and MTP alike, so alpha does not scale with depth."""
    means = [jnp.sum(total) / jnp.maximum(jnp.sum(count), 1.0) for total, count in sums]
    lm = means[0]
    mtp = jnp.mean(jnp.stack(means[1:])) if len(means) > 1 else jnp.zeros((), jnp.float32)
    per_layer = [s.balance_loss for s in router_stats if s is not None]
    balance = jnp.mean(jnp.concatenate(per_layer)) if per_layer else jnp.zeros((), jnp.float32)
    return Losses(lm + mtp_weight * mtp + balance_weight * balance, lm, mtp, balance)

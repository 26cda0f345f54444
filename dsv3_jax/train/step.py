"""The train and eval steps: pure functions of (state, batch), jitted once.

One train step: forward with MTP -> losses -> gradients -> skip guard -> clipped AdamW update ->
router-bias update from this batch's expert counts. The counts are sums over the whole batch
inside jit, so under a data/expert-sharded mesh they are the global loads the paper's rule needs.
`jit_kwargs` (e.g. in/out shardings from a mesh) pass through to `jax.jit`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv3_jax.model import lora
from sharding import pipeline
from dsv3_jax.train import balancing, losses, optimizer
from dsv3_jax.train.state import TrainState


def _model(graphdef, params, biases, dropout_key=None):
    model = nnx.merge(graphdef, params, biases)
    if dropout_key is not None:  # a training step: LoRA adapters with dropout draw this step's masks
        lora.with_dropout(model, dropout_key)
    return model


def _inputs(batch: dict) -> tuple[jax.Array, dict]:
    """Packed rows [B, T + 1] -> the model's tokens [B, T] and their `positions` and `segment_ids`."""
    inputs, _, _ = losses.inputs_and_targets(batch)
    t = inputs.shape[1]
    return inputs, {"positions": batch["positions"][:, :t], "segment_ids": batch["segment_ids"][:, :t]}


def _forward(model, batch, *, with_mtp: bool, indexer_loss: bool = False):
    inputs, where = _inputs(batch)
    return model.forward(inputs, **where, with_mtp=with_mtp, indexer_loss=indexer_loss), losses.Head.of(model)


def _counts(stats):
    return None if stats is None else stats.expert_counts


def _dropped_fraction(*stats) -> jax.Array:
    """Mean over the MoE layers (main and MTP) of each layer's dropped (token, expert) fraction."""
    per_layer = [s.dropped_fraction for s in stats if s is not None]
    return jnp.mean(jnp.concatenate(per_layer)) if per_layer else jnp.float32(0)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: Callable, *,
                    mtp_weight: float, balance_weight: float, bias_update_speed: float,
                    jit_kwargs: dict | None = None, donate: bool = False, trainable: dict | None = None,
                    indexer_weight: float = 0.0):
    """Returns jitted `train_step(state, batch) -> (state, metrics)`; `state` is donated with
    `donate` (the trainer's choice: it halves the state's memory, and the caller must then read
    nothing from a state once the next step has it, e.g. no async save's host views).

    batch: int32 `tokens`, `segment_ids`, `positions` [B, T + 1]. metrics: scalar `loss`,
    `lm_loss`, `mtp_loss`, `balance_loss`, `grad_norm`, `lr`, `skipped` (this step's update was
    dropped), `consecutive_skips` (the new state's count, readable after the state is donated to
    the next step), `dropped_fraction` ((token, expert) pairs past the expert capacity; 0 when dropless), and `expert_counts` [L_moe, E] / `mtp_expert_counts` [M, E] where the model has them.

    `indexer_weight` > 0 (a V3.2 model): the lightning indexers' KL to the main attention, summed
    over layers, joins the loss with this weight and the metrics as `indexer_loss`.

    `trainable` (`optimizer.trainable_mask`; None: all): only those parameters are differentiated
    and updated (LoRA adapters); the rest enter the step as constants. `tx` and `state.opt_state`
    cover the trainable ones only (`init_train_state(..., trainable)`).
    """

    def loss_fn(train_params, all_params, biases, batch, key):
        params = optimizer.combine(all_params, train_params)
        model = _model(graphdef, params, biases, key)
        rows = batch["tokens"].shape[0]
        micro = pipeline.outer_microbatches(rows, jax.sharding.get_abstract_mesh(), model.config.outer_microbatches)
        if micro > 1:  # no device holds its whole batch's logits
            if indexer_weight:
                raise ValueError(f"loss.indexer_weight={indexer_weight}: the indexer trains without outer "
                                 "microbatches (set config.model.outer_microbatches=1)")
            return _losses_in_microbatches(model, batch, micro, mtp_weight=mtp_weight, balance_weight=balance_weight)
        out, head = _forward(model, batch, with_mtp=True, indexer_loss=indexer_weight > 0)
        parts = losses.training_losses(out, batch, mtp_weight=mtp_weight, balance_weight=balance_weight, head=head,
                                       indexer_weight=indexer_weight)
        return parts.total, (parts, _counts(out.router_stats), _counts(out.mtp_router_stats),
                             _dropped_fraction(out.router_stats, out.mtp_router_stats))

    def train_step(state: TrainState, batch: dict, bias_update_speed: jax.Array):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        train_params = optimizer.select(state.params, trainable)
        (loss, (parts, main_counts, mtp_counts, dropped)), grads = grad_fn(train_params, state.params,
                                                                           state.router_bias, batch, state.rng)
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(grads, state.opt_state, train_params)
        params = optimizer.combine(state.params, optax.apply_updates(train_params, updates))
        biases = balancing.update_router_biases(state.router_bias, main_counts, mtp_counts, bias_update_speed)

        def guard(new, old):  # a non-finite step leaves every piece of state as it was
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        skip = (~finite).astype(jnp.int32)
        new_state = state.replace(
            step=state.step + 1, params=guard(params, state.params), router_bias=guard(biases, state.router_bias),
            opt_state=guard(opt_state, state.opt_state), rng=_next_key(state.rng), skipped=state.skipped + skip,
            consecutive_skips=(state.consecutive_skips + 1) * skip)
        metrics = {"loss": loss, "lm_loss": parts.lm, "mtp_loss": parts.mtp, "balance_loss": parts.balance,
                   "grad_norm": grad_norm, "lr": schedule(state.step - state.skipped), "skipped": skip,
                   "consecutive_skips": new_state.consecutive_skips, "dropped_fraction": dropped}
        if indexer_weight:
            metrics["indexer_loss"] = parts.indexer
        if main_counts is not None:
            metrics["expert_counts"] = main_counts
        if mtp_counts is not None:
            metrics["mtp_expert_counts"] = mtp_counts
        return new_state, metrics

    jitted = jax.jit(train_step, donate_argnums=(0,) if donate else (), **(jit_kwargs or {}))
    # gamma is an argument, not a constant, so runs that differ only in it share one executable.
    return functools.partial(jitted, bias_update_speed=jnp.float32(bias_update_speed))


def _losses_in_microbatches(model, batch: dict, micro: int, *, mtp_weight: float, balance_weight: float):
    """`loss_fn`'s result with the layers outside the MoE stack run in `micro` slices of the batch
    (`DeepSeekV3.forward_in_microbatches`): per slice the summed NLL and target count of the main
    head and each MTP depth, added up before the means, so the losses are the whole batch's. The
    head is applied by the losses (`losses.nll_sums`), as on the plain path."""
    head = losses.Head.of(model)

    def sums(out, rows):
        return losses.nll_sums(out.hidden, out.mtp_hidden, rows, head), out.mtp_router_stats

    inputs, where = _inputs(batch)
    (parts, mtp_stats), stats = model.forward_in_microbatches(inputs, sums, batch, **where, microbatches=micro)
    if mtp_stats is not None:  # [micro, depths, ...]: counts add up, means over equal slices average
        mtp_stats = type(mtp_stats)(jnp.sum(mtp_stats.expert_counts, 0), jnp.mean(mtp_stats.balance_loss, 0),
                                    jnp.mean(mtp_stats.dropped_fraction, 0))
    total = losses.objective(parts, (stats, mtp_stats), mtp_weight=mtp_weight, balance_weight=balance_weight)
    return total.total, (total, _counts(stats), _counts(mtp_stats), _dropped_fraction(stats, mtp_stats))


def _next_key(key_data: jax.Array) -> jax.Array:
    return jax.random.key_data(jax.random.split(jax.random.wrap_key_data(key_data))[0])


def make_eval_step(graphdef: nnx.GraphDef):
    """Returns jitted `eval_step(state, batch) -> (summed next-token NLL, valid tokens)`."""

    def eval_step(state: TrainState, batch: dict):
        out, head = _forward(_model(graphdef, state.params, state.router_bias), batch, with_mtp=False)
        _, targets, mask = losses.inputs_and_targets(batch)
        return losses.head_cross_entropy(head, out.hidden, targets, mask)

    return jax.jit(eval_step)

"""EPLB balance: max/mean tokens per expert-parallel device before and after placing N redundant
experts (N = 0, E/8, E/4), from routed counts, not only predicted.

    python -m benchmarks.eplb_balance --checkpoint=runs/tiny [--batches=8] [--devices=2,4] \
        [--zipf_experts=256 --zipf_devices=32 --zipf_tokens=65536]

Trained model: the run's held-out batches, first half recorded (the expert load an operator would
record with --record_expert_load), the placement fitted to it (sharding/eplb.py), then the second
half run through the placed model (load_pretrained's placement: dsv3_jax/model/moe.py:place_experts)
and the tokens each physical expert received counted by the forward (`replica_counts`); a device's
tokens are those of its physical experts (P / devices consecutive ones). "before" is the default
placement (expert e on device e // (E / devices)) on the same second half.
Synthetic: Zipf(1.2) expert popularity (expert of rank r drawn with weight r^-1.2, the ranks
shuffled per layer), K distinct experts per token; fitted on one draw of tokens, counted on
another through the model's token -> replica rule (`dsv3_jax.ops.routing.to_replicas`).
Each row: max/mean per device averaged over the MoE layers; "predicted" is EPLB's own estimate
(each expert's load split evenly over its replicas) on the measured half.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from sharding import eplb
from dsv3_jax import cli, load_pretrained
from dsv3_jax.model import moe
from dsv3_jax.ops import routing
from research.quant_quality import heldout_batches, whole_rows


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("checkpoint", None, "training run folder (its held-out split is read)", flag_values=fv)
    flags.DEFINE_integer("batches", 8, "held-out batches (half to record, half to measure)", flag_values=fv)
    flags.DEFINE_list("devices", ["2", "4"], "expert-parallel device counts for the trained model", flag_values=fv)
    flags.DEFINE_integer("zipf_experts", 256, "experts of the synthetic load", flag_values=fv)
    flags.DEFINE_integer("zipf_layers", 58, "MoE layers of the synthetic load", flag_values=fv)
    flags.DEFINE_integer("zipf_top_k", 8, "experts per token of the synthetic load", flag_values=fv)
    flags.DEFINE_integer("zipf_devices", 32, "expert-parallel devices for the synthetic load", flag_values=fv)
    flags.DEFINE_integer("zipf_tokens", 16384, "tokens per draw of the synthetic load", flag_values=fv)


def per_device(counts_LxP: np.ndarray, devices: int) -> float:
    """max/mean tokens per device, averaged over layers, the devices holding consecutive slots."""
    return eplb.imbalance(counts_LxP.reshape(counts_LxP.shape[0], devices, -1).sum(-1))


def redundant_counts(experts: int) -> list[int]:
    return [0, experts // 8, experts // 4]


@nnx.jit
def _router_stats(model, tokens_BxT):
    return model.forward(tokens_BxT).router_stats


def routed(model, rows_BxT: np.ndarray):
    """The main stack's router statistics (leaves [L_moe, ...]) over the rows, as numpy."""
    return jax.device_get(_router_stats(model, jnp.asarray(rows_BxT)))


def trained_rows(checkpoint: str, batches: int, devices: list[int]) -> list[tuple]:
    model = load_pretrained(checkpoint)
    cfg = model.config
    rows = whole_rows(heldout_batches(checkpoint, cfg.vocab_size, batches))
    fit, measure = np.array_split(rows, 2)
    recorded = routed(model, fit).expert_counts
    default = routed(model, measure).expert_counts
    out = []
    for d in devices:
        for n in redundant_counts(cfg.num_routed_experts):
            if (cfg.num_routed_experts + n) % d:
                continue
            placement = eplb.rebalance(recorded, cfg.num_routed_experts + n, cfg.num_expert_groups, 1, d)
            placed = load_pretrained(checkpoint)
            moe.place_experts(placed.moe_layers.ffn, placement)
            counts = routed(placed, measure).replica_counts
            predicted = eplb.imbalance(eplb.device_loads(default, placement, d))
            out.append((f"trained ({checkpoint}, {len(measure)}x{measure.shape[1]} held-out tokens)",
                        cfg.num_routed_experts, d, n, per_device(default, d), predicted, per_device(counts, d)))
    return out


def zipf_draw(rng, top_k: int, tokens: int, ranks_E: np.ndarray) -> np.ndarray:
    """int32 [tokens, K]: K distinct experts per token, expert e drawn with weight (rank_e + 1)^-1.2
    (Gumbel top-k: sampling without replacement)."""
    keys = np.log(rng.random((tokens, ranks_E.size))) / (ranks_E + 1.0) ** -1.2
    return np.argsort(-keys, axis=-1)[:, :top_k].astype(np.int32)


def to_replicas(experts_NxK: np.ndarray, replicas_ExR: np.ndarray) -> np.ndarray:
    return np.asarray(routing.to_replicas(jnp.asarray(experts_NxK), jnp.asarray(replicas_ExR)))


def zipf_rows(experts: int, layers: int, top_k: int, devices: int, tokens: int) -> list[tuple]:
    rng = np.random.default_rng(0)
    ranks = [rng.permutation(experts) for _ in range(layers)]
    fit, measure = ([zipf_draw(rng, top_k, tokens, r) for r in ranks] for _ in range(2))
    recorded = np.stack([np.bincount(f.reshape(-1), minlength=experts) for f in fit]).astype(np.float64)
    default = np.stack([np.bincount(m.reshape(-1), minlength=experts) for m in measure]).astype(np.float64)
    out = []
    for n in redundant_counts(experts):
        placement = eplb.rebalance(recorded, experts + n, 1, 1, devices)
        counts = np.stack([np.bincount(to_replicas(m, replicas).reshape(-1), minlength=experts + n)
                           for m, replicas in zip(measure, placement.logical_to_physical)]).astype(np.float64)
        predicted = eplb.imbalance(eplb.device_loads(default, placement, devices))
        out.append((f"Zipf(1.2), {layers} layers, top-{top_k}, {tokens} tokens", experts, devices, n,
                    per_device(default, devices), predicted, per_device(counts, devices)))
    return out


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    cli.numbers(args, "devices")
    rows = []
    try:
        if args.checkpoint:
            rows += trained_rows(args.checkpoint, args.batches, args.devices)
        rows += zipf_rows(args.zipf_experts, args.zipf_layers, args.zipf_top_k, args.zipf_devices, args.zipf_tokens)
    except (ValueError, OSError) as e:
        return cli.fail(e)
    print("| load | E | devices | redundant N | max/mean before | after, predicted | after, counted |")
    print("|---|---|---|---|---|---|---|")
    for load, e, d, n, before, predicted, counted in rows:
        print(f"| {load} | {e} | {d} | {n} | {before:.3f} | {predicted:.3f} | {counted:.3f} |")
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

"""Plans the 671B int4 deployments whose routed experts live in host RAM behind a device cache of C
experts per MoE layer (`dsv3_jax/inference/expert_cache.py`), before booking them:

    python -m experiments.plan_offload [--context=32768] [--headroom=0.9] [--host_link_gbps=64]

Per deployment: the bytes that stay on the devices (`plan_serving.plan` of the model without its
routed MoE-stack experts: every other weight, the latent cache, the decode step's working set, the
MTP depth's experts), the largest C whose slots [L_moe, C] (stored format) and one layer's C experts in
the compute dtype fit beside them in `headroom` of HBM, the host RAM the store takes, and the
tokens/s the host link bounds at a hit rate h: a decode step of one row without MTP looks up K experts
per MoE layer, so it moves L_moe K (1 - h) experts per token, and tokens/s <= links x link bytes/s /
those bytes. An upper bound from the link alone (compute and latency come on top). The offloaded
model loads its routed experts straight into host memory (`load_pretrained(offload_experts=True)`),
so a device holds only the resident part and the slots; the expert cache runs on one device, so a
row of more devices is a plan, not a command that runs today (no row has run on a GPU here).
"""

from __future__ import annotations

import math
import sys

from absl import flags

from dsv3_jax import ModelConfig, cli
from experiments import plan_serving as ps

# Host -> device bandwidth of one device's link, with its source (GB/s = 1e9 bytes/s, one direction).
HOST_LINKS = {
    "h100": (64e9, "NVIDIA H100 data sheet: PCIe Gen5 x16, 128 GB/s both directions"),
    "h200": (64e9, "NVIDIA H200 data sheet: PCIe Gen5 x16, 128 GB/s both directions"),
}
# Google's Cloud TPU pages (v5e, v5p, v6e, v7x) give HBM, ICI and per-host DRAM but no host-link
# bandwidth per chip: a TPU plan takes it from --host_link_gbps.
TABLE = (("671B int4, 1 x H200 + host RAM", "h200", 1), ("671B int4, 2 x H100 + host RAM", "h100", 2))
HIT_RATES = (0.5, 0.8, 0.9, 0.95, 0.99)


def expert_bytes(cfg: ModelConfig, weights: str, group: int) -> float:
    """One routed expert's w1, w3 ([D, F]) and w2 ([F, D]) in the weight format."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    one = lambda shape: ps.quantized_bytes(shape, (0, 1), True, weights, group)  # noqa: E731
    return 2 * one((d, f)) + one((f, d))


def offload_plan(cfg: ModelConfig, chip: str, devices: int, *, weights: str = "int4", context: int = 32768,
                 headroom: float = 0.9, link: float | None = None) -> dict:
    dep = ps.Deployment(chip, {"expert": devices}, weights, max_batch=devices, context=context)
    model = ps.abstract_model(cfg)
    p = ps.plan(cfg, dep, headroom=headroom, model=model)
    layers, e, eb = cfg.num_moe_layers, cfg.num_routed_experts, expert_bytes(cfg, weights, dep.group)
    one_layer = "one MoE layer's local experts (compute dtype)"
    resident = p.total - layers * e * eb / devices - p.working[one_layer]
    per_slot = layers * eb + 3.0 * cfg.hidden_size * cfg.moe_intermediate_size * 2  # + one layer's, bf16
    cache = min(e, math.floor((headroom * p.hbm - resident) * devices / per_slot))
    link = link if link is not None else HOST_LINKS[chip][0]
    moved = {h: layers * cfg.num_experts_per_token * (1 - h) * eb for h in HIT_RATES}
    return {"resident": resident, "cache": cache, "cache_bytes": cache * per_slot / devices,
            "host": layers * e * eb, "expert": eb, "link": link,
            "tokens_per_s": {h: devices * link / b for h, b in moved.items()}, "moved": moved, "hbm": p.hbm}


def report(cfg: ModelConfig, *, context: int, headroom: float, link_gbps: float | None, out=sys.stdout) -> list:
    rows = []
    for label, chip, devices in TABLE:
        link = link_gbps * 1e9 if link_gbps else None
        r = offload_plan(cfg, chip, devices, context=context, headroom=headroom, link=link)
        k, source = cfg.num_experts_per_token, "--host_link_gbps" if link_gbps else HOST_LINKS[chip][1]
        fits = f"C = {r['cache']} of {cfg.num_routed_experts} per layer" if r["cache"] >= k else \
            f"does not fit (C = {r['cache']} < top_k = {k})"
        print(f"== {label}: per device {r['resident'] / 1e9:.1f} GB resident + {r['cache_bytes'] / 1e9:.1f} GB expert "
              f"cache of {r['hbm'] / 1e9:.0f} GB x {headroom:.0%}: {fits}; host RAM {r['host'] / 1e9:.0f} GB, loaded "
              f"there directly "
              f"({r['expert'] / 1e6:.1f} MB per expert); host link {r['link'] / 1e9:.0f} GB/s x {devices} "
              f"({source})", file=out)
        print("  tokens/s bound by the host link (one row, no MTP), by hit rate: " + ", ".join(
            f"{h:.2f}: {t:.1f} ({r['moved'][h] / 1e9:.2f} GB/token)" for h, t in r["tokens_per_s"].items()), file=out)
        rows.append(r)
    return rows


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_enum("model", "deepseek_v3", ["deepseek_v3", "deepseek_v3_1", "deepseek_v3_2"],
                      "ModelConfig preset (its weights planned as int4)", flag_values=fv)
    flags.DEFINE_integer("context", 32768, "tokens of latent cache per row", flag_values=fv)
    flags.DEFINE_float("headroom", 0.9, "share of HBM the plan may use", flag_values=fv)
    flags.DEFINE_float("host_link_gbps", None, "host -> device GB/s per device (default: the chip's PCIe link)",
                       flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    if args.context <= 0 or not 0 < args.headroom <= 1 or (args.host_link_gbps is not None and args.host_link_gbps <= 0):
        cli.usage(f"--context={args.context} must be positive, --headroom={args.headroom} in (0, 1] and "
                  f"--host_link_gbps={args.host_link_gbps} positive")
    try:
        cfg = getattr(ModelConfig, args.model)().replace(compute_dtype="bfloat16", param_dtype="bfloat16")
        report(cfg, context=args.context, headroom=args.headroom, link_gbps=args.host_link_gbps)
    except ValueError as e:
        return cli.fail(e)
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

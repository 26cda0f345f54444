"""Places routed experts over expert-parallel devices from a recorded load (EPLB, sharding/eplb.py).

    python -m experiments.eplb --load=load.json --devices=64 --redundant=32 [--groups=8 --nodes=8] --out=placement.npz

--load is a record written by `experiments.generate` or `experiments.serve` with
--record_expert_load (routed tokens per MoE layer and expert). The placement holds
devices x per-device physical experts (experts + --redundant), packed hierarchically when --groups
expert groups split over --nodes nodes, globally otherwise; pass it to `experiments.generate` or
`experiments.serve` as --expert_placement on a mesh whose `expert` axis is --devices. Prints the
predicted max/mean tokens per device, averaged over the layers, before (expert e on device
e // (E / devices)) and after.
"""

from __future__ import annotations

from absl import flags

from sharding import eplb
from dsv3_jax import cli


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("load", None, "expert-load record (--record_expert_load's .json or .npz)", required=True,
                        flag_values=fv)
    flags.DEFINE_integer("devices", None, "expert-parallel devices (the mesh's `expert` axis)", required=True,
                         flag_values=fv)
    flags.DEFINE_integer("redundant", 0, "redundant physical experts", flag_values=fv)
    flags.DEFINE_integer("groups", 1, "expert groups (the model's num_expert_groups) for hierarchical packing",
                         flag_values=fv)
    flags.DEFINE_integer("nodes", 1, "nodes the devices sit on (hierarchical packing when groups split over them)",
                         flag_values=fv)
    flags.DEFINE_string("out", None, "placement file to write (.npz)", required=True, flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    try:
        _, load_LxE = eplb.read_load(args.load)
        layers, experts = load_LxE.shape
        placement = eplb.rebalance(load_LxE, experts + args.redundant, args.groups, args.nodes, args.devices)
        before = eplb.imbalance(eplb.device_loads(load_LxE, eplb.default_placement(layers, experts), args.devices))
        after = eplb.imbalance(eplb.device_loads(load_LxE, placement, args.devices))
        eplb.save_placement(args.out, placement)
    except (ValueError, OSError) as e:
        return cli.fail(e, args.out)
    print(f"{layers} MoE layers, {experts} experts + {args.redundant} redundant on {args.devices} devices: "
          f"predicted max/mean tokens per device {before:.3f} -> {after:.3f}; placement written to {args.out}")
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

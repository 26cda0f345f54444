"""Expert-parallel load balancing (EPLB): redundant experts placed by recorded load.

Letters: L MoE layers, E logical experts, P physical experts (E + redundant), R most replicas of
one expert (P - E + 1), G expert groups, X rows of a packing problem, N items per row.

DeepSeek's published algorithm (deepseek-ai/EPLB), written here from its description:
- balanced packing: items heaviest first, each onto the lightest pack that still has room, every
  pack ending with the same number of items;
- replication: each redundant slot goes to the expert whose load per replica is highest now;
- hierarchical (when the expert groups divide over the nodes): pack the groups onto nodes, then
  replicate within each node, then pack each node's physical experts onto its devices;
  global otherwise: one node and one group, the same three steps.
A physical expert's load is its logical expert's load split evenly over the replicas.

Physical expert p lives on expert-parallel device p // (P / devices), the layout
sharding/expert_parallel.py uses, so a placement is a permutation-with-copies of the experts.
No model knowledge: loads and placements are numpy arrays and files.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

LOAD_AXES = ("layer", "expert")


class Placement(NamedTuple):
    physical_to_logical: np.ndarray  # int32 [L, P]: the logical expert physical slot p holds
    logical_to_physical: np.ndarray  # int32 [L, E, R]: expert e's replicas, -1 past replica_count
    replica_count: np.ndarray  # int32 [L, E]: replicas of each logical expert (>= 1)

    @property
    def redundant(self) -> int:
        return self.physical_to_logical.shape[1] - self.replica_count.shape[1]


def balanced_packing(weight_XxN: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Items onto `num_packs` packs of N / num_packs items each, heaviest item first onto the
    lightest pack with room. Returns (pack [X, N], rank of the item within its pack [X, N])."""
    rows, n = weight_XxN.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} packs of equal count")
    per_pack = n // num_packs
    pack_XxN = np.zeros((rows, n), np.int64)
    rank_XxN = np.zeros((rows, n), np.int64)
    for x in range(rows):
        pack_weight = np.zeros(num_packs)
        pack_items = np.zeros(num_packs, np.int64)
        for item in np.argsort(-weight_XxN[x], kind="stable"):
            open_packs = np.flatnonzero(pack_items < per_pack)
            pack = open_packs[np.argmin(pack_weight[open_packs])]
            pack_XxN[x, item], rank_XxN[x, item] = pack, pack_items[pack]
            pack_weight[pack] += weight_XxN[x, item]
            pack_items[pack] += 1
    return pack_XxN, rank_XxN


def replicate(weight_XxN: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N items -> `num_physical` slots: slot i < N holds item i, each further slot a copy of the
    item with the highest load per copy. Returns (item of each slot [X, P], replica rank of each
    slot [X, P], copies of each item [X, N])."""
    rows, n = weight_XxN.shape
    slot_item = np.tile(np.arange(num_physical), (rows, 1))
    slot_rank = np.zeros((rows, num_physical), np.int64)
    count = np.ones((rows, n), np.int64)
    for slot in range(n, num_physical):
        heaviest = np.argmax(weight_XxN / count, axis=1)
        slot_item[:, slot] = heaviest
        slot_rank[:, slot] = count[np.arange(rows), heaviest]
        count[np.arange(rows), heaviest] += 1
    return slot_item, slot_rank, count


def _inverse(perm_XxN: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm_XxN)
    np.put_along_axis(inv, perm_XxN, np.broadcast_to(np.arange(perm_XxN.shape[1]), perm_XxN.shape), axis=1)
    return inv


def _hierarchical(load_LxE, num_physical, num_groups, num_nodes, num_devices):
    """(physical -> logical [L, P], replica rank of each physical slot [L, P], copies [L, E])."""
    layers, e = load_LxE.shape
    group_size, groups_per_node = e // num_groups, num_groups // num_nodes
    node_experts, node_physical = e // num_nodes, num_physical // num_nodes
    # 1. groups onto nodes; node-major order of the logical experts ("node order")
    group_load = load_LxE.reshape(layers, num_groups, group_size).sum(-1)
    node, rank = balanced_packing(group_load, num_nodes)
    group_slot = node * groups_per_node + rank  # [L, G]: where each group sits in node order
    to_node_order = (group_slot[:, :, None] * group_size + np.arange(group_size)).reshape(layers, e)
    from_node_order = _inverse(to_node_order)
    # 2. replicas within each node
    node_load = np.take_along_axis(load_LxE, from_node_order, 1).reshape(layers * num_nodes, node_experts)
    slot_item, slot_rank, count = replicate(node_load, node_physical)
    # 3. each node's physical experts onto its devices
    slot_load = np.take_along_axis(node_load / count, slot_item, 1)
    device, rank = balanced_packing(slot_load, num_devices // num_nodes)
    per_device = num_physical // num_devices
    from_position = _inverse(device * per_device + rank)  # [L * nodes, P / nodes]: slot at each position
    node_offset = np.tile(np.arange(num_nodes) * node_experts, layers)[:, None]  # rows are (layer, node)
    item = np.take_along_axis(slot_item, from_position, 1) + node_offset
    physical_to_logical = np.take_along_axis(from_node_order, item.reshape(layers, num_physical), 1)
    replica_rank = np.take_along_axis(slot_rank, from_position, 1).reshape(layers, num_physical)
    copies = np.take_along_axis(count.reshape(layers, e), to_node_order, 1)
    return physical_to_logical, replica_rank, copies


def rebalance(load_LxE: np.ndarray, num_physical: int, num_groups: int, num_nodes: int,
              num_devices: int) -> Placement:
    """A placement of `num_physical` experts over `num_devices` expert-parallel devices for the
    per-layer expert loads: hierarchical when the `num_groups` expert groups split evenly over
    `num_nodes`, global otherwise (module docstring)."""
    load_LxE = np.asarray(load_LxE, np.float64)
    layers, e = load_LxE.shape
    if num_physical < e:
        raise ValueError(f"num_physical={num_physical} is fewer than the {e} logical experts")
    if num_physical % num_devices:
        raise ValueError(f"num_physical={num_physical} experts do not split over num_devices={num_devices}")
    if num_devices % num_nodes:
        raise ValueError(f"num_devices={num_devices} do not split over num_nodes={num_nodes}")
    if e % num_groups:
        raise ValueError(f"{e} experts do not split into num_groups={num_groups}")
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    physical_to_logical, rank_LxP, count_LxE = _hierarchical(load_LxE, num_physical, num_groups, num_nodes,
                                                             num_devices)
    logical_to_physical = np.full((layers, e, num_physical - e + 1), -1, np.int64)
    layer_L = np.arange(layers)[:, None]
    logical_to_physical[layer_L, physical_to_logical, rank_LxP] = np.arange(num_physical)
    return Placement(physical_to_logical.astype(np.int32), logical_to_physical.astype(np.int32),
                     count_LxE.astype(np.int32))


def default_placement(num_layers: int, num_experts: int) -> Placement:
    """Expert e in physical slot e, one replica each: the layout without EPLB."""
    slots = np.tile(np.arange(num_experts, dtype=np.int32), (num_layers, 1))
    return Placement(slots, slots[:, :, None], np.ones((num_layers, num_experts), np.int32))


def placement_for(path: str | os.PathLike | None, redundant: int | None, *, num_layers: int, num_experts: int,
                  num_groups: int, num_devices: int) -> Placement:
    """The placement `--expert_placement=path --redundant_experts=redundant` asks for: `path`'s
    file (whose redundant count must be `redundant` when that is given too), or, without a file,
    `redundant` replicas placed for a uniform load."""
    if path is None:
        if not redundant or redundant < 0:
            raise ValueError(f"redundant_experts={redundant}: give a positive count or an expert_placement file")
        load = np.ones((num_layers, num_experts))
        return rebalance(load, num_experts + redundant, num_groups, 1, num_devices)
    placement = load_placement(path)
    if redundant is not None and redundant != placement.redundant:
        raise ValueError(f"redundant_experts={redundant} but {path} places {placement.redundant} redundant experts")
    return placement


def device_loads(load_LxE: np.ndarray, placement: Placement, num_devices: int) -> np.ndarray:
    """Predicted tokens per device [L, devices]: each expert's load split evenly over its replicas."""
    if placement.physical_to_logical.shape[1] % num_devices:
        raise ValueError(f"{placement.physical_to_logical.shape[1]} physical experts do not split over "
                         f"{num_devices} devices")
    per_replica_LxE = np.asarray(load_LxE, np.float64) / placement.replica_count
    physical_LxP = np.take_along_axis(per_replica_LxE, placement.physical_to_logical.astype(np.int64), 1)
    return physical_LxP.reshape(physical_LxP.shape[0], num_devices, -1).sum(-1)


def imbalance(device_load_LxD: np.ndarray) -> float:
    """max / mean tokens per device, averaged over layers (1.0 is perfect balance)."""
    mean = np.maximum(device_load_LxD.mean(-1), 1e-12)
    return float(np.mean(device_load_LxD.max(-1) / mean))


def save_placement(path: str | os.PathLike, placement: Placement) -> None:
    """An .npz archive at exactly `path` (np.savez given a name would append ".npz" to any other)."""
    with open(path, "wb") as f:
        np.savez(f, **placement._asdict())


def load_placement(path: str | os.PathLike) -> Placement:
    """A placement written by `save_placement`, its arrays checked against one another."""
    try:
        with np.load(path) as f:
            placement = Placement(*(np.asarray(f[k], np.int32) for k in Placement._fields))
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"{path} is not an expert placement (.npz with {', '.join(Placement._fields)}): {err}")
    p2l, l2p, count = placement
    layers, e = count.shape
    if p2l.shape[0] != layers or l2p.shape[:2] != (layers, e) or (count < 1).any() or (p2l >= e).any():
        raise ValueError(f"{path}: inconsistent placement (physical_to_logical {p2l.shape}, logical_to_physical "
                         f"{l2p.shape}, replica_count {count.shape})")
    held_LxE = np.zeros((layers, e), np.int32)
    np.add.at(held_LxE, (np.arange(layers)[:, None], p2l), 1)
    if (held_LxE != count).any():
        raise ValueError(f"{path}: replica_count disagrees with physical_to_logical")
    return placement


def write_load(path: str | os.PathLike, counts_LxE: np.ndarray, first_layer: int) -> None:
    """Routed tokens per (MoE layer, expert), the layers numbered from `first_layer` as in the
    model: JSON, or .npz, with the axes named."""
    counts_LxE = np.asarray(counts_LxE, np.float64)
    layers = first_layer + np.arange(counts_LxE.shape[0])
    if os.fspath(path).endswith(".npz"):
        np.savez(path, counts=counts_LxE, layers=np.asarray(layers), axes=np.asarray(LOAD_AXES))
        return
    with open(path, "w") as f:
        json.dump({"axes": list(LOAD_AXES), "layers": [int(i) for i in layers], "counts": counts_LxE.tolist()}, f)


def read_load(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(layer ids [L], counts [L, E]) from `write_load`'s file."""
    try:
        if os.fspath(path).endswith(".npz"):
            with np.load(path) as f:
                record = {k: f[k] for k in ("axes", "layers", "counts")}
        else:
            with open(path) as f:
                record = json.load(f)
        axes, layers, counts = tuple(record["axes"]), np.asarray(record["layers"]), np.asarray(record["counts"])
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"{path} is not an expert-load record (axes, layers, counts): {err}")
    if axes != LOAD_AXES or counts.ndim != 2 or counts.shape[0] != layers.shape[0]:
        raise ValueError(f"{path}: counts {counts.shape} must be [layer, expert] with one row per layer id")
    return layers, counts.astype(np.float64)

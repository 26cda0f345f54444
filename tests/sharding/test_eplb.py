"""EPLB (sharding/eplb.py): the packing and replication rules on loads whose answer is known by
hand, the placement's properties on skewed loads (every device its count, every expert a replica,
a lighter busiest device), routing to replicas, the files, and on 8 fake devices a placed model's
logits and greedy tokens against the default placement's."""

import contextlib
import io

import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.ops import routing
from experiments import eplb as eplb_cli
from experiments import generate
from sharding import eplb
from tests.sharding.workers import run_worker

PROMPTS = ["--prompt=a fox", "--prompt=the cat sat on the mat and", "--prompt=over"]


def zipf_load(layers: int, experts: int, seed: int = 0) -> np.ndarray:
    """[L, E] Zipf(1.2) draws: a few experts take most tokens."""
    return np.random.default_rng(seed).zipf(1.2, (layers, experts)).astype(np.float64)


def test_balanced_packing_puts_the_heaviest_item_on_the_lightest_open_pack():
    # 10 -> pack 0, 9 -> pack 1, 1 -> pack 1 (lighter), 1 -> pack 0 (pack 1 is full): {10, 1} {9, 1}
    pack, rank = eplb.balanced_packing(np.array([[1.0, 10.0, 1.0, 9.0]]), 2)
    assert pack.tolist() == [[1, 0, 0, 1]] and rank.tolist() == [[1, 0, 1, 0]]


def test_replication_gives_each_copy_to_the_highest_load_per_copy():
    # loads 8, 3, 1: copies go to 8 (8 > 3), then 8/2 = 4 > 3 again, then 3 > 8/3
    slot_item, slot_rank, count = eplb.replicate(np.array([[8.0, 3.0, 1.0]]), 6)
    assert slot_item.tolist() == [[0, 1, 2, 0, 0, 1]] and slot_rank.tolist() == [[0, 0, 0, 1, 2, 1]]
    assert count.tolist() == [[3, 2, 1]]


@pytest.mark.parametrize("nodes", [1, 2])  # 2: hierarchical (4 groups over 2 nodes); 1: global
@pytest.mark.parametrize("redundant", [0, 4, 8])
def test_placement_properties_on_a_skewed_load(nodes, redundant):
    layers, experts, groups, devices = 3, 16, 4, 4
    load = zipf_load(layers, experts)
    placement = eplb.rebalance(load, experts + redundant, groups, nodes, devices)
    p2l, l2p, count = placement
    assert p2l.shape == (layers, experts + redundant) and placement.redundant == redundant
    for layer in range(layers):
        held = np.bincount(p2l[layer], minlength=experts)
        assert (held >= 1).all() and (held == count[layer]).all()
        for e in range(experts):  # the map back lists exactly the slots holding e, -1 after them
            slots = l2p[layer, e]
            assert sorted(slots[:count[layer, e]]) == np.flatnonzero(p2l[layer] == e).tolist()
            assert (slots[count[layer, e]:] == -1).all()
        if nodes > 1:  # hierarchical: a group's experts and all their replicas on one node
            node_of_slot = np.arange(experts + redundant) // ((experts + redundant) // nodes)
            group_nodes = {}
            for slot, e in enumerate(p2l[layer]):
                assert group_nodes.setdefault(e // (experts // groups), node_of_slot[slot]) == node_of_slot[slot]
    before = eplb.device_loads(load, eplb.default_placement(layers, experts), devices)
    after = eplb.device_loads(load, placement, devices)
    np.testing.assert_allclose(after.sum(-1), load.sum(-1))  # every token still goes somewhere, once
    if redundant:
        assert (after.max(-1) <= before.max(-1) + 1e-9).all() and eplb.imbalance(after) < eplb.imbalance(before)


def test_a_bad_split_names_the_count():
    with pytest.raises(ValueError, match="num_physical=18 experts do not split over num_devices=4"):
        eplb.rebalance(zipf_load(1, 16), 18, 4, 1, 4)


def test_tokens_take_an_experts_replicas_in_turn():
    replicas_ExR = jnp.array([[0, 3, 4], [1, -1, -1], [2, 5, -1]], jnp.int32)  # 3 copies of 0, 2 of 2
    experts_NxK = jnp.array([[0, 2], [0, 1], [0, 2], [2, 0]], jnp.int32)
    got = np.asarray(routing.to_replicas(experts_NxK, replicas_ExR))
    assert got.tolist() == [[0, 2], [3, 1], [4, 2], [5, 0]]  # token n: replica n mod count


def test_files_round_trip_and_a_bad_file_is_named(tmp_path):
    counts = zipf_load(2, 8)
    for name in ("load.json", "load.npz"):
        eplb.write_load(tmp_path / name, counts, 3)
        layers, read = eplb.read_load(tmp_path / name)
        assert layers.tolist() == [3, 4] and np.array_equal(read, counts)
    placement = eplb.rebalance(counts, 12, 4, 1, 4)
    for name in ("p.npz", "placement.json"):  # written at exactly the path given, whatever its suffix
        eplb.save_placement(tmp_path / name, placement)
        assert all(np.array_equal(a, b) for a, b in zip(eplb.load_placement(tmp_path / name), placement))
    np.savez(tmp_path / "bad.npz", physical_to_logical=placement.physical_to_logical,
             logical_to_physical=placement.logical_to_physical, replica_count=placement.replica_count + 1)
    with pytest.raises(ValueError, match="bad.npz: replica_count disagrees"):
        eplb.load_placement(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="redundant_experts=2 but .* places 4"):
        eplb.placement_for(tmp_path / "p.npz", 2, num_layers=2, num_experts=8, num_groups=4, num_devices=4)


def test_cli_writes_a_placement_that_lowers_the_predicted_max_over_mean(tmp_path, capsys):
    load = zipf_load(2, 16)
    eplb.write_load(tmp_path / "load.json", load, 1)
    assert eplb_cli.main([f"--load={tmp_path / 'load.json'}", "--devices=4", "--redundant=4",
                          f"--out={tmp_path / 'p.npz'}"]) == 0
    printed = capsys.readouterr().out
    placement = eplb.load_placement(tmp_path / "p.npz")
    after = eplb.imbalance(eplb.device_loads(load, placement, 4))
    before = eplb.imbalance(eplb.device_loads(load, eplb.default_placement(2, 16), 4))
    assert f"{before:.3f} -> {after:.3f}" in printed and after < before
    assert eplb_cli.main([f"--load={tmp_path / 'none.json'}", "--devices=4", f"--out={tmp_path / 'q.npz'}"]) == 2
    assert "none.json" in capsys.readouterr().err


def test_placement_on_8_fake_devices_keeps_logits_and_greedy_tokens(trained_run, tmp_path):
    """expert=8 and tensor=2 x expert=4, 8 redundant experts placed for a skewed load: logits equal
    the default placement's (1e-5, fp32), tokens reach the redundant replicas and sum back to each
    expert's count, each device holds (E + 8) / expert of the copied weights; on expert=8
    experiments.generate's greedy tokens equal the one-device default's (itself held equal to the
    default mesh's by tests/serving/test_mesh_serve.py, whose mesh server runs a placement too)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert generate.main([f"--checkpoint={trained_run}", *PROMPTS, "--max_new_tokens=6"]) == 0
    want = [line for line in out.getvalue().splitlines() if not line.startswith(("prefill", "MTP"))]
    rows = run_worker("tests.sharding.eplb_worker", str(trained_run), str(tmp_path), *PROMPTS)
    assert [r["mesh"] for r in rows] == ["expert=8", "tensor=2,expert=4"]
    for r, expert_axis in zip(rows, (8, 4)):
        assert r["max_abs_diff"] <= 1e-5, r
        assert r["tokens"] == (want if expert_axis == 8 else None), r
        assert r["weights_are_copies"], r
        physical = len(r["physical_to_logical"][0])
        assert r["experts_per_device"] == [(physical - 8) // expert_axis, physical // expert_axis]
        counts, p2l = np.array(r["replica_counts"]), np.array(r["physical_to_logical"])
        spread = [np.count_nonzero(counts[layer][p2l[layer] == e]) for layer in range(len(p2l)) for e in p2l[layer]]
        assert max(spread) >= 2  # some expert's tokens were shared between two of its replicas
        logical = np.zeros_like(np.array(r["expert_counts"]))  # the physical counts summed back per expert
        np.add.at(logical, (np.arange(len(p2l))[:, None], p2l), counts)
        np.testing.assert_array_equal(logical, r["expert_counts"])
    _, recorded = eplb.read_load(rows[0]["record"])  # the prompts' routed tokens, all layers alike
    assert recorded.shape == (len(p2l), physical - 8) and len(set(recorded.sum(-1))) == 1


"""Expert parallelism: all-to-all in shard_map equals the single-device dispatch (8 fake devices).

Dropless (and a capacity that cannot drop) give the same outputs and gradients as
`dispatch.routed_experts`; a small capacity factor drops exactly the rows a numpy model of the
rule drops (per source device and destination, rows past the capacity in (token, slot) order).
"""

from sharding import expert_parallel
from tests.sharding.workers import run_worker


def test_capacity():
    assert expert_parallel.capacity(32, 4, None) == 32  # dropless: the worst case
    assert expert_parallel.capacity(32, 4, 1.0) == 8
    assert expert_parallel.capacity(32, 4, 1.25) == 10
    assert expert_parallel.capacity(32, 4, 100.0) == 32


def test_expert_parallel_matches_single_device_dispatch():
    """Both exchanges (padded all_to_all; ragged_all_to_all, run through its all_gather emulation
    on CPU) give the single-device dispatch, dropless and with a capacity factor, and the real
    ragged collective lowers for TPU and CUDA."""
    rows = run_worker("tests.sharding.ep_worker")
    for exchange in ("padded", "ragged"):
        mine = [r for r in rows if r.get("exchange") == exchange]
        ops = mine[0]
        if exchange == "padded":
            assert ops["all_to_all_ops"] >= 3, ops  # there (tokens, expert ids) and back
        else:
            assert ops["all_to_all_ops"] == 0 and ops["all_gather_ops"] > 0, ops
        dropless = [r for r in mine if "cf" in r and r["cf"] in (None, 4.0)]
        assert len(dropless) == 2
        for r in dropless:  # cf=4 = P: never drops
            assert r["out_rel"] < 1e-6 and r["grad_rel"] < 1e-5, r
        dropping = [r for r in mine if r.get("cf") in (0.5, 1.0)]
        assert len(dropping) == 2
        for r in dropping:  # the skewed routing overflows: dropped rows contribute zero, as the numpy model says
            assert r["dropped"] > 0 and r["out_rel"] < 1e-6 and r["differs_from_dropless"] > 0.1, r
    lowered = {r["lowered"]: r["ragged_all_to_all_ops"] for r in rows if "lowered" in r}
    assert lowered.keys() == {"tpu", "cuda"} and min(lowered.values()) >= 3, lowered

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
    rows = run_worker("tests.sharding.ep_worker")
    assert rows[0]["all_to_all_ops"] >= 2  # there and back (the backward adds its own)
    exact = {r["cf"]: r for r in rows[1:3]}
    for cf in (None, 4.0):
        assert exact[cf]["out_rel"] < 1e-6 and exact[cf]["grad_rel"] < 1e-5, exact[cf]
    for r in rows[3:]:
        assert r["dropped"] > 0 and r["differs_from_dropless"] > 0.1, r
        assert r["out_rel"] < 1e-6, r

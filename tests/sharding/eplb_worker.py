"""EPLB on 8 fake CPU devices (JSON lines): per mesh (expert=8; tensor=2 x expert=4), a run's model
loaded with redundant experts placed by EPLB for a skewed load against the default placement: the
logits, the tokens each physical expert received and the placed weights on each device; on
expert=8 also the greedy tokens of `experiments.generate` (its --expert_placement and
--record_expert_load flags; tensor=2 x expert=4's greedy answers are the mesh server's,
tests/serving/test_mesh_serve.py).

    python -m tests.sharding.eplb_worker RUN_DIR OUT_DIR --prompt=... [--prompt=...]
"""

import contextlib
import io
import json
import os
import sys

from tests.helpers import fake_device_flags

os.environ.setdefault("XLA_FLAGS", fake_device_flags(8, fast_compile=True))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import sharding  # noqa: E402
from sharding import eplb  # noqa: E402
from dsv3_jax import load_pretrained  # noqa: E402
from experiments import generate  # noqa: E402

MESHES = {"expert=8": {"expert": 8}, "tensor=2,expert=4": {"tensor": 2, "expert": 4}}
REDUNDANT = 8


def forward(model, mesh, tokens):
    """(float32 logits [B, T, V], tokens per logical expert [L, E], per physical one [L, P] or None)
    under `mesh`."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        out = nnx.merge(graphdef, state).forward(tokens)
        return out.logits, out.router_stats.expert_counts, out.router_stats.replica_counts

    with jax.set_mesh(mesh):
        return jax.device_get(run(state, tokens))


def generated(run_dir, mesh_text, prompts, *flags):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = generate.main([f"--checkpoint={run_dir}", *prompts, "--max_new_tokens=6", f"--mesh={mesh_text}", *flags])
    assert code == 0, out.getvalue()
    return [line for line in out.getvalue().splitlines() if not line.startswith(("prefill", "MTP"))]


def main(run_dir: str, out_dir: str, *prompts: str) -> None:
    tokens = np.asarray(np.random.default_rng(0).integers(3, 1000, (2, 24)), np.int32)
    for mesh_text, axes in MESHES.items():
        mesh = sharding.make_mesh(axes)
        default = load_pretrained(run_dir, mesh=mesh)
        cfg = default.config
        record = os.path.join(out_dir, f"load_{mesh_text}.json")
        placement = eplb.rebalance(skewed_load(cfg.num_moe_layers, cfg.num_routed_experts), cfg.num_routed_experts
                                   + REDUNDANT, cfg.num_expert_groups, 1, axes["expert"])
        path = os.path.join(out_dir, f"placement_{mesh_text}.npz")
        eplb.save_placement(path, placement)
        placed = load_pretrained(run_dir, mesh=mesh, expert_placement=path)
        (want, _, _), (got, logical, counts) = forward(default, mesh, tokens), forward(placed, mesh, tokens)
        w1_default, w1_placed = (m.moe_layers.ffn.w1.get_value() for m in (default, placed))
        layer_L = np.arange(cfg.num_moe_layers)[:, None]
        tokens_text = None if axes.get("tensor") else generated(
            run_dir, mesh_text, prompts, f"--expert_placement={path}", f"--record_expert_load={record}")
        print(json.dumps({
            "mesh": mesh_text, "max_abs_diff": float(np.max(np.abs(got - want))),
            "tokens": tokens_text,
            "record": record, "physical_to_logical": placement.physical_to_logical.tolist(),
            "replica_counts": counts.tolist(), "expert_counts": logical.tolist(),
            "weights_are_copies": bool(np.array_equal(np.asarray(w1_placed),
                                                      np.asarray(w1_default)[layer_L, placement.physical_to_logical])),
            "experts_per_device": [s.shard_shape(x.shape)[1] for x in (w1_default, w1_placed) for s in [x.sharding]],
        }), flush=True)


def skewed_load(layers: int, experts: int) -> np.ndarray:
    """[L, E] tokens per expert, Zipf(1.2)-like: expert e gets 1000 / (e + 1)^1.2, shuffled per layer."""
    rng = np.random.default_rng(0)
    return np.stack([rng.permutation(1000 / np.arange(1, experts + 1) ** 1.2) for _ in range(layers)])


if __name__ == "__main__":
    main(*sys.argv[1:])

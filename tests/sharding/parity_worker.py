"""Runs one train step (and three) on meshes and on one device; prints JSON differences per mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharding.parity_worker \
        data=8 fsdp=2,tensor=2,expert=2 ...

Run by tests/sharding/test_parity.py in a subprocess (the pytest process has one device).
Differences are relative in the 2-norm per array, the largest over all arrays.

The gradients compared are the train step's own: after its first step AdamW's first moment holds
(1 - b1) x the clipped gradient of every array, and the metrics its global norm before clipping, so
one compiled step per mesh checks the gradients, the loss curve and the parameters. The collectives
(stage hand-offs, expert all-to-alls) are read from the model's loss and gradients, lowered only:
the step's optimizer adds collectives of its own.
"""

from __future__ import annotations

import json
import os
import sys

from tests.helpers import FAST_COMPILE, fake_device_flags, tree_rel_err  # noqa: F401 (FAST_COMPILE: re-exported)

# Cheap XLA:CPU codegen: compiling dominates these runs (4x faster at level 0); the reference and
# the sharded steps are compiled alike, so the comparison is unaffected.
if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", fake_device_flags(8, fast_compile=True))

import jax
import numpy as np
import optax
from flax import nnx

import sharding
from dsv3_jax import DeepSeekV3, ModelConfig
from dsv3_jax.train import losses, optimizer as opt_lib, sharded, state as state_lib, step as step_lib
from experiments.configs import tiny

# The tiny preset shrunk (every feature on: q LoRA, groups, shared expert, MTP), with 4 MoE layers
# so that pipeline=2 and pipeline=4 both divide them.
SHAPE = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_layers=5, num_heads=2,
             q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
BATCH, SEQ, STEPS = 16, 32, 3
LOSS_KW = dict(mtp_weight=0.3, balance_weight=1e-4, bias_update_speed=1e-3)


def parse_mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (item.split("=") for item in text.split(","))}


def setup(overrides: dict | None = None):
    config = tiny.get_config()
    model_dict = config.model.to_dict()
    model_dict.update(SHAPE, **(overrides or {}))
    cfg = ModelConfig.from_dict(model_dict)
    model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
    _, params, _ = state_lib.split_model(model)
    tx = opt_lib.make_optimizer(config.optimizer, 10, opt_lib.decay_mask(params))
    schedule = opt_lib.make_schedule(config.optimizer, 10)
    graphdef, state = state_lib.init_train_state(model, tx, 0)
    return cfg, model, graphdef, tx, schedule, state


def make_batches(vocab: int, n: int) -> list[dict]:
    """Packed rows: two documents per row (segment ids 1, 2), positions restarting, some padding."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, (BATCH, SEQ + 1), dtype=np.int32)
        cut = rng.integers(4, SEQ - 4, (BATCH, 1))
        idx = np.arange(SEQ + 1)[None]
        seg = np.where(idx < cut, 1, 2).astype(np.int32)
        seg[:, -3:] = 0
        pos = np.where(idx < cut, idx, idx - cut).astype(np.int32)
        out.append({"tokens": tokens, "segment_ids": seg, "positions": pos})
    return out


def grad_fn(graphdef):
    def loss(params, biases, batch):
        model = nnx.merge(graphdef, params, biases)
        inputs, _, _ = losses.inputs_and_targets(batch)
        t = inputs.shape[1]
        out = model.forward(inputs, positions=batch["positions"][:, :t], segment_ids=batch["segment_ids"][:, :t],
                            with_mtp=True)
        return losses.training_losses(out, batch, mtp_weight=LOSS_KW["mtp_weight"],
                                      balance_weight=LOSS_KW["balance_weight"]).total

    return jax.jit(jax.value_and_grad(loss))


def run(state, step, batches, place):
    """The state after the steps, the loss and gradient-norm curves, and AdamW's first moment after
    the first step ((1 - b1) x that step's clipped gradients, on the host before the next step)."""
    loss_curve, norm_curve, first_moment = [], [], None
    for batch in batches:
        state, m = step(state, place(batch))
        loss_curve.append(float(m["loss"]))
        norm_curve.append(float(m["grad_norm"]))
        if first_moment is None:
            first_moment = jax.device_get(optax.tree_utils.tree_get(state.opt_state, "mu"))
    return state, loss_curve, norm_curve, first_moment


def main(args: list[str]) -> None:
    """args: meshes like `data=2,expert=4` (`pipeline=4,data=2:1f1b`: under that pipeline schedule,
    `:circular` with 2 rounds),
    and `--name=value` model overrides (e.g. --num_layers=4)."""
    overrides = {k[2:]: int(v) for k, v in (a.split("=", 1) for a in args if a.startswith("--"))}
    meshes = [a for a in args if not a.startswith("--")]
    cfg, model, graphdef, tx, schedule, state = setup(overrides)
    batches = make_batches(cfg.vocab_size, STEPS)
    ref_step = step_lib.make_train_step(graphdef, tx, schedule, **LOSS_KW)
    ref_state, ref_curve, ref_norms, ref_moment = run(state, ref_step, batches, lambda b: b)
    for text in meshes:
        mesh_text, _, pipe_schedule = text.partition(":")  # `pipeline=4,data=2:1f1b`: under that schedule
        run_graphdef = graphdef
        if pipe_schedule:  # `circular` runs 2 rounds
            run_cfg = cfg.replace(pipeline_schedule=pipe_schedule, pipeline_repeats=2 if pipe_schedule == "circular" else 1)
            run_graphdef = state_lib.init_train_state(DeepSeekV3(run_cfg, rngs=nnx.Rngs(0)), tx, 0)[0]
        mesh = sharding.make_mesh(parse_mesh(mesh_text))
        shardings = sharded.train_state_shardings(model, state, mesh)
        placed = jax.device_put(state, shardings)
        step = sharded.make_sharded_train_step(run_graphdef, tx, schedule, shardings, mesh, **LOSS_KW)
        final, curve, norms, moment = run(placed, step, batches, lambda b: sharded.place_batch(b, mesh))
        with jax.set_mesh(mesh):  # the model's loss and gradients, lowered (not compiled) as the step traces them
            lowered = grad_fn(run_graphdef).lower(final.params, final.router_bias, sharded.place_batch(batches[0], mesh))
        hlo = lowered.as_text()
        kept = all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in
                   zip(jax.tree.leaves(final.params), jax.tree.leaves(shardings.params)))
        # ZeRO-1: every moment (leaves with a shape) split over `data` when the mesh has it
        zero1 = all("data" in str(a.sharding.spec) for a in jax.tree.leaves(final.opt_state) if a.ndim)
        grad_rel = max(tree_rel_err(moment, ref_moment), abs(norms[0] - ref_norms[0]) / ref_norms[0])
        print(json.dumps({"mesh": text, "moments_over_data": zero1, "moe_layers": cfg.num_moe_layers, "loss": curve[0],
                          "stage_handoff": "collective_permute" in hlo, "expert_all_to_all": "all_to_all" in hlo,
                          "ref_loss": ref_curve[0], "loss_rel": abs(curve[0] - ref_curve[0]) / abs(ref_curve[0]),
                          "grad_rel": grad_rel, "params_rel": tree_rel_err(final.params, ref_state.params),
                          "bias_rel": tree_rel_err(final.router_bias, ref_state.router_bias),
                          "curve": curve, "ref_curve": ref_curve, "shardings_kept": kept}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

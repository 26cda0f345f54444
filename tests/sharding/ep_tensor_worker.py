"""Expert parallelism with tensor ranks: MoE FLOPs per device and the loss against one device (JSON lines).

    python -m tests.sharding.ep_tensor_worker [--loss]

On 8 fake CPU devices, at one global batch:
- the MoE layer's forward and backward (router, shared expert, routed experts through the
  all-to-all), compiled for `expert=4` on 4 devices and for `tensor=2, expert=4` on 8, and the
  compiler's FLOPs per device (`cost_analysis`). The routed experts run the `dense` grouped matmul
  here: the CPU default (`tiled`) is a while loop, whose trip count the cost analysis does not
  see, while the dense one is straight-line and costs rows x local experts, so it follows the
  rows each device computes;
- with `--loss`, the whole model's loss and gradients on `tensor=2, expert=4` (default grouped
  matmul) against the single-device step of tests/sharding/parity_worker.py (the test suite checks
  this on `fsdp=2, tensor=2, expert=2` in tests/sharding/test_parity.py instead, where it costs
  no extra compile of the reference).
"""

import dataclasses
import json
import sys
import os

from tests.helpers import fake_device_flags, tree_rel_err

os.environ.setdefault("XLA_FLAGS", fake_device_flags(8, fast_compile=True))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import sharding  # noqa: E402
from dsv3_jax import ModelConfig  # noqa: E402
from dsv3_jax.model.moe import MoE  # noqa: E402
from dsv3_jax.train import sharded  # noqa: E402
from experiments.configs import tiny  # noqa: E402
from tests.sharding import parity_worker  # noqa: E402

MESHES = {"expert4": ({"expert": 4}, 4), "tensor2_expert4": ({"tensor": 2, "expert": 4}, 8)}


def moe_flops(cfg, mesh) -> float:
    """Compiled FLOPs per device of grad(sum(sin(MoE(x)))) over the layer's variables and x."""
    graphdef, variables = nnx.split(MoE(dataclasses.replace(cfg, moe_impl="dense"), rngs=nnx.Rngs(0)))
    rules = sharding.get_rules("default")
    pure = nnx.to_pure_dict(variables)
    var_sh = sharding.follow_params(pure, sharded.variable_shardings(variables, mesh, rules), mesh)
    x_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(rules["batch"], None, None))
    x = jax.ShapeDtypeStruct((parity_worker.BATCH, parity_worker.SEQ, cfg.hidden_size), jnp.float32, sharding=x_sh)
    abstract = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), pure, var_sh)

    def loss(pure, x_BxTxD):
        y, _ = nnx.merge(graphdef, pure)(x_BxTxD)
        return jnp.sum(jnp.sin(y))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(abstract, x).compile()
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def flops_rows():
    """Printed by this worker and by tests/sharding/ep_worker.py (whose process the test suite runs)."""
    cfg = ModelConfig.from_dict({**tiny.get_config().model.to_dict(), **parity_worker.SHAPE})
    for name, (sizes, devices) in MESHES.items():
        mesh = sharding.make_mesh(sizes, devices=jax.devices()[:devices])
        print(json.dumps({"flops_mesh": name, "devices": devices, "moe_flops_per_device": moe_flops(cfg, mesh)}),
              flush=True)


def main(args: list[str]):
    flops_rows()
    if "--loss" in args:
        loss_against_one_device()


def loss_against_one_device():
    _, model, graphdef, _, _, state = parity_worker.setup()
    batch = parity_worker.make_batches(model.config.vocab_size, 1)[0]
    grads = parity_worker.grad_fn(graphdef)
    ref_loss, ref_grads = grads(state.params, state.router_bias, batch)
    mesh = sharding.make_mesh(MESHES["tensor2_expert4"][0])
    placed = jax.device_put(state, sharded.train_state_shardings(model, state, mesh))
    with jax.set_mesh(mesh):
        loss, g = grads(placed.params, placed.router_bias, sharded.place_batch(batch, mesh))
    print(json.dumps({"mesh": "tensor2_expert4", "loss": float(loss), "ref_loss": float(ref_loss),
                      "loss_rel": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                      "grad_rel": tree_rel_err(g, ref_grads)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

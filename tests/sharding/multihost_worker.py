"""One process of a two-process run (4 fake CPU devices each, `jax.distributed` on 127.0.0.1), or
the single 8-device process it is compared with. Trains STEPS steps of the parity model on mesh
(data=2, fsdp=2, expert=2); process 0 prints the loss curve and a parameter checksum as JSON.

    python -m tests.sharding.multihost_worker PORT NUM_PROCESSES PROCESS_ID
"""

import json
import os
import sys

from tests.helpers import fake_device_flags

if __name__ == "__main__":
    _, _port, _nproc, _pid = sys.argv
    devices = 8 // int(_nproc)
    os.environ["XLA_FLAGS"] = fake_device_flags(devices, fast_compile=True)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import sharding  # noqa: E402
from sharding import multihost  # noqa: E402
from dsv3_jax import DeepSeekV3  # noqa: E402
from dsv3_jax.train import sharded, state as state_lib  # noqa: E402
from tests.sharding import parity_worker as pw  # noqa: E402

MESH = {"data": 2, "fsdp": 2, "expert": 2}


def main(port: int, num_processes: int, process_id: int):
    if num_processes > 1:
        assert multihost.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 8 // num_processes
    cfg, _, _, tx, schedule, _ = pw.setup()
    batches = pw.make_batches(cfg.vocab_size, pw.STEPS)
    mesh = sharding.make_mesh(MESH)

    def make_model():
        return DeepSeekV3(cfg, rngs=nnx.Rngs(0))

    model = nnx.eval_shape(make_model)
    graphdef, abstract = state_lib.abstract_train_state(model, tx, 0)
    shardings = sharded.train_state_shardings(model, abstract, mesh)
    state = state_lib.fresh_train_state(make_model, tx, 0, shardings)  # each process: its devices' shards
    step = sharded.make_sharded_train_step(graphdef, tx, schedule, shardings, mesh, **pw.LOSS_KW)
    row_sharding = sharded.batch_sharding(mesh)

    def global_batch(batch):
        rows = multihost.process_rows(row_sharding, batch["tokens"].shape)
        local = {k: v[rows] for k, v in batch.items()}  # what this process's data loader would read
        return multihost.global_batch(local, row_sharding, pw.BATCH)

    if num_processes > 1:  # as the trainer: compiled on both before the first collective (gloo's 30 s join)
        step.compile(state, global_batch(batches[0]))
        multihost.barrier("multihost_worker_compiled")
    curve = []
    for batch in batches:
        state, metrics = step(state, global_batch(batch))
        curve.append(float(metrics["loss"]))
    # A replicated reduction every process can read: the sum of squares of every parameter.
    sq = jax.jit(lambda p: sum(jax.numpy.sum(x * x) for x in jax.tree.leaves(p)),
                 out_shardings=sharding.replicated(mesh))(state.params)
    if jax.process_index() == 0:
        print(json.dumps({"processes": jax.process_count(), "curve": curve, "param_sq": float(sq)}), flush=True)


if __name__ == "__main__":
    main(int(_port), int(_nproc), int(_pid))

"""`--init_from` on a mesh (8 fake CPU devices, fsdp=2 x expert=4): the weights are built shard by
shard in the shardings training uses, and training from them gives the loss curve of the
single-device run from the same checkpoint."""

import json
import sys

import pytest

from tests.sharding import workers
from tests.sharding.parity_worker import FAST_COMPILE
from tests.train.test_init_from import hf_folder  # noqa: F401  (the module fixture)

FLAGS = ["--steps=2", "--config.data.batch_size=8", "--config.train.eval_every=0", "--config.train.log_every=1",
         "--config.train.checkpoint_every=100", "--config.train.compilation_cache=",
         "--config.optimizer.warmup_steps=1"]


def _losses(workdir, hf, devices: int, *mesh) -> list[float]:
    env = workers.fake_device_env(XLA_FLAGS="--xla_cpu_collective_timeout_seconds=900 "
                                  f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")
    out = workers.run([sys.executable, "-m", "experiments.train", f"--workdir={workdir}", f"--init_from={hf}",
                       *FLAGS, *mesh], env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(workdir / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


def test_init_from_on_a_mesh_trains_like_one_device(hf_folder, tmp_path):  # noqa: F811
    one = _losses(tmp_path / "one", hf_folder, 1)
    mesh = _losses(tmp_path / "mesh", hf_folder, 8, "--config.mesh.data=1", "--config.mesh.fsdp=2",
                   "--config.mesh.expert=4")
    assert len(one) == 2
    assert mesh == pytest.approx(one, rel=1e-5)

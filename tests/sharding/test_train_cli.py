"""`python -m experiments.train --config.mesh.<axis>=N` on 8 fake CPU devices gives the loss curve
of the single-device run (issue acceptance 1, last clause)."""

import json
import os
import sys

import pytest

from tests import helpers

REPO = helpers.REPO
STEPS = 3
OVERRIDES = [
    *helpers.shrunk_flags(num_layers=5), "--config.data.seq_len=32", "--config.data.batch_size=8",
    "--config.optimizer.warmup_steps=2", "--config.train.eval_every=0", "--config.train.log_every=1",
    "--config.train.checkpoint_every=100", "--config.train.compilation_cache=", f"--steps={STEPS}",
]


def train_losses(workdir, devices: int, *mesh_flags) -> list[float]:
    env = helpers.fake_device_env(XLA_FLAGS=helpers.fake_device_flags(devices, fast_compile=True))
    cmd = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *OVERRIDES, *mesh_flags]
    out = helpers.run(cmd, env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["dropped_fraction"] == 0.0 for r in records)  # dropless by default, on every mesh
    return [r["loss"] for r in records], out.stderr


# Every axis through the command line at least once, pipeline=4 under DualPipeV (the schedule chosen
# on the command line); each mesh's step, and fsdp=8 and the pipeline x
# expert mesh, are held per array against one device in tests/sharding/test_parity.py.
MESHES = {"ep": {"data": 2, "expert": 4}, "fsdp_tp_ep": {"fsdp": 2, "tensor": 2, "expert": 2},
          "pp4_dualpipev": {"pipeline": 4, "data": 2}}
MODEL_FLAGS = {"pp4_dualpipev": ["--config.model.pipeline_schedule=dualpipev"]}


@pytest.fixture(scope="module")
def one_device_curve(tmp_path_factory):
    return train_losses(tmp_path_factory.mktemp("one"), 1)[0]


@pytest.mark.parametrize("name", MESHES)
def test_mesh_overrides_give_the_single_device_loss_curve(tmp_path, one_device_curve, name):
    sizes = dict.fromkeys(("data", "fsdp", "tensor", "expert", "pipeline"), 1) | MESHES[name]
    curve, log = train_losses(tmp_path, 8, *(f"--config.mesh.{a}={n}" for a, n in sizes.items()),
                              *MODEL_FLAGS.get(name, []))
    assert "mesh {" in log and all(f"'{a}': {n}" in log for a, n in MESHES[name].items()), log[-2000:]
    assert curve == pytest.approx(one_device_curve, rel=1e-5), (name, curve, one_device_curve)


@pytest.mark.parametrize("flags, message", [
    (["--config.mesh.data=-1", "--config.data.batch_size=12"], "data.batch_size=12 is not divisible by data=8"),
    (["--config.mesh.pipeline=2", "--config.mesh.data=4", "--config.model.pipeline_microbatches=3"],
     "pipeline_microbatches=3 must divide the batch of 8 rows"),
    (["--config.mesh.pipeline=2", "--config.mesh.data=4", "--config.model.pipeline_repeats=2",
      "--config.model.pipeline_microbatches=1"], "pipeline_microbatches=1 is fewer than the 2 stages"),
    (["--config.mesh.pipeline=8", "--config.mesh.data=1"], "pipeline=8 stages exceed the 4 layers they split"),
])
def test_bad_mesh_is_a_clear_error(tmp_path, flags, message):
    env = helpers.fake_device_env(8)
    out = helpers.run([sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", *OVERRIDES, *flags], env,
                      timeout=600)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]



def test_launch_local_two_processes_of_one_device_train(tmp_path):
    """The documented multi-host command on one machine, one CPU device per process, the bundled
    model: every all-reduce of the step crosses processes (gloo), which pairs them by the order each
    process issues them, so both must issue them in the program's order (dsv3_jax/host.py)."""
    env = helpers.without_cluster(helpers.fake_device_env(XLA_FLAGS=helpers.fake_device_flags(1, fast_compile=True)))
    out = helpers.run_module("experiments.launch.local", "--processes=2", f"--port={helpers.free_port()}",
                             f"--log_dir={tmp_path / 'logs'}", "--",
                             f"--workdir={tmp_path}", "--steps=2", "--config.data.seq_len=32",
                             "--config.data.batch_size=4", "--config.mesh.data=2", "--config.train.eval_every=0",
                             "--config.train.compilation_cache=", "--config.train.log_every=1", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "logs" / "launch_local.1.log").exists()
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)

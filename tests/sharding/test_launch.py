"""Launcher dry runs: a 64-host TPU pod, a 2 x 32 multi-slice pod and a
2-node SLURM job print, per host, the process id, the coordinator and the same training command
with its mesh flags. The SLURM coordinator and ids are checked against jax's own SLURM detection."""

import re
import shlex

import pytest
from jax._src.clusters.slurm_cluster import SlurmCluster

from experiments.launch import local, slurm, tpu_pod

TRAIN = ["--config=experiments/configs/deepseek_v3_671b.py", "--config.mesh.pipeline=8", "--config.mesh.expert=32",
         "--config.mesh.data=-1", "--workdir=gs://bucket/run"]
LINE = re.compile(r"\[process (\d+) on (\S+)\] (.*)")


def _lines(capsys, main, argv):
    assert main(argv) == 0
    return [LINE.match(line).groups() for line in capsys.readouterr().out.splitlines() if LINE.match(line)]


def _remote(command: str) -> tuple[dict, list[str]]:
    """--command='cd DIR && K=V ... python -m experiments.train FLAGS' -> (env, argv)."""
    words = shlex.split(command.split("&&", 1)[1])
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
    return env, [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]


def _pod(capsys, slices: int, per_slice: int):
    argv = ["--tpu", "v5p", "--zone", "us-east5-a", "--slices", str(slices), "--dry_run",
            "--workers_per_slice", str(per_slice), "--", *TRAIN]
    out = []
    for pid, host, line in _lines(capsys, tpu_pod.main, argv):
        ssh = shlex.split(line)
        command = next(w for w in ssh if w.startswith("--command="))[len("--command="):]
        worker = int(next(w for w in ssh if w.startswith("--worker="))[len("--worker="):])
        out.append((int(pid), host, ssh[5], worker, *_remote(command)))
    return out


def test_64_host_pod(capsys):
    rows = _pod(capsys, 1, 64)
    assert [r[0] for r in rows] == list(range(64))
    for pid, host, name, worker, env, argv in rows:
        assert (name, worker, host) == ("v5p", pid, f"v5p-w-{pid}")
        assert env == {"JAX_COORDINATOR_ADDRESS": "v5p-w-0:8476", "JAX_NUM_PROCESSES": "64", "JAX_PROCESS_ID": str(pid)}
        assert argv == ["python", "-m", "experiments.train", *TRAIN]


def test_multi_slice_pod(capsys):
    rows = _pod(capsys, 2, 32)
    assert [r[0] for r in rows] == list(range(64))
    for pid, host, name, worker, env, argv in rows:
        assert (name, worker) == (f"v5p-{pid // 32}", pid % 32)
        assert env["JAX_PROCESS_ID"] == str(pid) and env["JAX_NUM_PROCESSES"] == "64"
        assert env["JAX_COORDINATOR_ADDRESS"] == "v5p-0-w-0:8476"
        assert env["MEGASCALE_SLICE_ID"] == str(pid // 32) and env["MEGASCALE_NUM_SLICES"] == "2"
        assert argv == ["python", "-m", "experiments.train", *TRAIN, "--config.mesh.dcn_data=2"]


def test_two_node_slurm_job_matches_jax_slurm_detection(capsys, monkeypatch):
    nodelist, job = "gpu[007-008]", 4242
    rows = _lines(capsys, slurm.main, ["--nodes", "2", "--dry_run", "--nodelist", nodelist, "--job_id", str(job),
                                       "--", *TRAIN])
    assert [(int(p), h) for p, h, _ in rows] == [(0, "gpu007"), (1, "gpu008")]
    for pid, _, line in rows:
        for key, value in {"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": nodelist, "SLURM_NTASKS": "2",
                           "SLURM_PROCID": pid, "SLURM_LOCALID": "0"}.items():
            monkeypatch.setenv(key, value)
        env, argv = _remote("cd . && " + line)
        assert env["JAX_COORDINATOR_ADDRESS"] == SlurmCluster.get_coordinator_address(None, None)
        assert int(env["JAX_PROCESS_ID"]) == SlurmCluster.get_process_id()
        assert int(env["JAX_NUM_PROCESSES"]) == SlurmCluster.get_process_count()
        assert argv == ["python", "-m", "experiments.train", *TRAIN]


def test_slurm_script(tmp_path):
    out = tmp_path / "job.sbatch"
    assert slurm.main(["--nodes", "2", "--gpus_per_node", "8", "--out", str(out), "--", *TRAIN]) == 0
    script = out.read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun")))
    assert srun[-len(TRAIN) - 3:] == ["python", "-m", "experiments.train", *TRAIN]


@pytest.mark.parametrize("nodelist, nodes", [("node[1-3]", ["node1", "node2", "node3"]),
                                             ("a[01,05-06],b", ["a01", "a05", "a06", "b"])])
def test_nodelist(nodelist, nodes):
    assert slurm.expand_nodelist(nodelist) == nodes


def test_local_commands():
    cmds = local.commands(2, ["--", "--steps=3"], port=1234)
    assert [c.env for c in cmds] == [{"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
                                      "JAX_PROCESS_ID": str(i)} for i in range(2)]
    assert all(c.argv[1:] == ["-m", "experiments.train", "--steps=3"] for c in cmds)

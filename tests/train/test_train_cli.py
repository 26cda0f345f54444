"""End-to-end runs of `python -m experiments.train` in subprocesses (tiny model, a few steps)."""

import json
import os
import random
import shutil
import signal
import subprocess
import time

import numpy as np

from tests.helpers import run_module
from tests.train.conftest import REPO, RESUME_FLAGS, STEPS, read_records, run, run_train, train_command, train_env

COMPARED = ("loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "lr")


def test_metrics_file_has_the_documented_fields(uninterrupted):
    workdir, records, stderr = uninterrupted
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    required = {"step", "loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "lr", "tokens_per_sec",
                "mfu", "maxvio", "mtp_maxvio", "expert_load", "skipped_steps"}
    for r in records:
        assert required <= set(r), required - set(r)
        assert len(r["maxvio"]) == 1 and len(r["expert_load"][0]) == 16  # 1 MoE layer, 16 experts
        assert np.isclose(sum(r["expert_load"][0]), 1.0, atol=1e-3)
        # loss = lm + 0.3 mtp + 1e-4 balance (the config defaults)
        assert np.isclose(r["loss"], r["lm_loss"] + 0.3 * r["mtp_loss"] + 1e-4 * r["balance_loss"], rtol=1e-5)
        # mfu divides by the matmul peak measured once at start-up: on a contended machine that
        # peak can read low and a window high (CI saw 1.09), so the bound catches a wrong FLOP
        # count (a factor of several), not contention
        assert r["skipped_steps"] == 0 and r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 3
    assert [r["step"] for r in records if "eval_loss" in r] == [20, 40, 60]
    assert "ETA" in stderr and "tok/s" in stderr
    assert os.listdir(os.path.join(workdir, "tensorboard"))
    assert sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit()) == [56, 58, 60]


def test_sigkill_at_a_random_step_then_restart_continues_exactly(tmp_path, compile_cache, uninterrupted):
    _, reference, _ = uninterrupted
    kill_after = random.Random(os.getpid()).randint(3, STEPS // 2)
    cmd = train_command(tmp_path, *RESUME_FLAGS, cache_dir=compile_cache)
    proc = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics, checkpoints = tmp_path / "metrics.jsonl", tmp_path / "checkpoints"

    def finalized_checkpoint():  # async saves are renamed from a temporary name once complete
        return checkpoints.exists() and any(s.isdigit() for s in os.listdir(checkpoints))

    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after and finalized_checkpoint():
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before step {kill_after}: {proc.stderr.read()[-3000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(metrics.read_text().splitlines())
    assert killed_at < STEPS

    result = run_train(tmp_path, *RESUME_FLAGS, cache_dir=compile_cache)
    assert "resumed from" in result.stderr
    resumed = read_records(tmp_path)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for got, want in zip(resumed, reference):
        for key in COMPARED:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=f"step {got['step']} {key}")
        np.testing.assert_allclose(got["maxvio"], want["maxvio"], rtol=1e-6)
        if "eval_loss" in want:
            np.testing.assert_allclose(got["eval_loss"], want["eval_loss"], rtol=1e-6)


def test_plot_draws_curves_and_heatmap(uninterrupted, tmp_path):
    workdir, _, _ = uninterrupted
    result = run_module("experiments.plot", f"--workdir={workdir}", f"--out={tmp_path}", env=train_env(), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("loss.png", "expert_load.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_data_fails_early_naming_the_file(tmp_path, compile_cache):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = run_train(tmp_path / "run", f"--config.data.path={empty}", cache_dir=compile_cache,
                       check=False)
    assert result.returncode != 0
    assert str(empty) in result.stderr


def test_a_mesh_that_does_not_fit_the_devices_is_one_line(tmp_path, capsys):
    from experiments.train import main

    assert main([f"--workdir={tmp_path / 'run'}", "--steps=1", "--config.mesh.data=2"]) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert printed[-1] == ("error: mesh (data=2) needs 2 devices but 1 are available; change a size or set one "
                           "axis to -1"), printed[-3:]
    assert not any(line.startswith("Traceback") for line in printed)


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, compile_cache, uninterrupted):
    proc = subprocess.Popen(train_command(tmp_path, *RESUME_FLAGS, cache_dir=compile_cache), cwd=REPO,
                            env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    stopped_at = len(metrics.read_text().splitlines())
    assert stopped_at < STEPS and "SIGTERM" in stderr
    saved = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
    assert saved[-1] == stopped_at  # saved at the step it stopped, on the 2-step interval or not


def _resumable_copy(uninterrupted, tmp_path, keep_step: int):
    """The finished run copied, its checkpoints after `keep_step` removed: a run to resume there."""
    workdir = tmp_path / "run"
    shutil.copytree(uninterrupted[0], workdir)
    for step in os.listdir(workdir / "checkpoints"):
        if step.isdigit() and int(step) > keep_step:
            shutil.rmtree(workdir / "checkpoints" / step)
    return workdir


def test_resume_with_a_changed_model_field_stops_naming_it(tmp_path, compile_cache, uninterrupted):
    workdir = _resumable_copy(uninterrupted, tmp_path, 56)
    before = (workdir / "config.json").read_text()
    result = run_train(workdir, *RESUME_FLAGS, "--config.model.num_routed_experts=32", cache_dir=compile_cache,
                       check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: config.model.num_routed_experts=32 but the run being resumed has "
                           "num_routed_experts=16"), last
    assert (workdir / "config.json").read_text() == before  # the record still says what the run is


def test_resume_with_a_changed_run_field_applies_and_logs_it(tmp_path, compile_cache, uninterrupted):
    """The issue's case: a capacity factor given on the command line of a resumed run (one device
    has no expert exchange, so the curve continues exactly; the field is in what runs and recorded)."""
    _, reference, _ = uninterrupted
    workdir = _resumable_copy(uninterrupted, tmp_path, 56)
    result = run_train(workdir, *RESUME_FLAGS, "--config.model.expert_capacity_factor=1.5", cache_dir=compile_cache)
    assert "config.model.expert_capacity_factor=1.5 (was None in the run's model_config.json)" in result.stderr
    for name in ("model_config.json", "config.json"):
        record = json.loads((workdir / name).read_text())
        assert record.get("model", record)["expert_capacity_factor"] == 1.5, name
    resumed = read_records(workdir)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in reference], rtol=1e-6)


class _SlowScalar:
    """A step's value that is ready only after `seconds` (as a dispatched jax array is)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __float__(self):
        time.sleep(self.seconds)
        return 1.0


def test_the_logged_rate_counts_the_wait_for_the_steps_values():
    # The train loop dispatches a step and logs at once; the window must close when the step's
    # values are ready, not at dispatch (where a window of one step read ~100x too fast).
    from dsv3_jax.train import loop as train

    m = {key: _SlowScalar(0.05) for key in ("loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "lr",
                                            "dropped_fraction")}
    state = type("State", (), {"skipped": 0})()
    record = train._record(4, m, state, 3, time.perf_counter(), tokens_per_step=1000, flops_per_step=1e9, peak=1e12)
    assert record["tokens_per_sec"] <= 1000 / (7 * 0.05)

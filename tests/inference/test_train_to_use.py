"""From a training run to use, as a new user would: train the tiny default a few steps, generate from
the run folder, export it with `--to-hf` and load the export in transformers with the same logits."""

import os
import subprocess
import sys

import numpy as np
import pytest

from dsv3_jax import load_pretrained
from dsv3_jax.checkpoint import run_folder
from tests.train.conftest import REPO, STEPS, compile_cache, run_train, train_env  # noqa: F401 (fixture)


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=train_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, compile_cache):
    workdir = tmp_path_factory.mktemp("run")
    result = run_train(workdir, "--config.train.checkpoint_every=20", cache_dir=compile_cache)
    assert "experiments.generate --checkpoint=" in result.stdout and "--to-hf" in result.stdout, result.stdout
    return workdir


def test_run_folder_and_step_folder_resolve(run_dir):
    latest = run_folder.find(run_dir)
    assert latest.step == STEPS and latest.tokenizer is None  # the bundled tokenizer
    assert run_folder.find(run_dir / "checkpoints" / "20").step == 20
    assert run_folder.find(run_dir / "checkpoints").step == STEPS
    with pytest.raises(Exception, match="steps"):
        run_folder.find(run_dir / "checkpoints" / "7")


def test_generate_from_the_run_folder(run_dir):
    res = _run("experiments.generate", f"--checkpoint={run_dir}", "--prompt=Once upon a time", "--max_new_tokens=4",
               "--prefill_chunk=4")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("Once upon a time") and "tokens/s" in res.stdout, res.stdout
    assert f"at step {STEPS}" in res.stderr
    bad = _run("experiments.generate", f"--checkpoint={run_dir}/nothing_here", "--prompt=x")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "is not a checkpoint" in bad.stderr, \
        bad.stderr[-2000:]


def test_export_to_hf_loads_in_transformers_with_the_same_logits(run_dir, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    out = tmp_path / "hf"
    res = _run("dsv3_jax.convert", "--to-hf", f"--ckpt={run_dir}", f"--out={out}", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "tokenizer.json").is_file()
    model = load_pretrained(run_dir, dtype="float32")
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 12))
    ours = np.asarray(model(tokens))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)).logits.numpy()
    assert np.std(ours) > 0.1
    assert np.max(np.abs(ours - theirs)) <= 1e-4 * np.max(np.abs(theirs))
    again = _run("dsv3_jax.convert", "--to-hf", f"--ckpt={run_dir}", f"--out={out}", "--no-progress")
    assert again.returncode == 2 and "already exists" in again.stderr

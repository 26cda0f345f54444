"""LoRA through its command line: `python -m experiments.train --config=experiments/configs/lora.py
--init_from=RUN` on a model pretrained here lowers the held-out loss, trains the adapters only,
resumes exactly after a stop, and on an fsdp=2 x expert=4 mesh gives the single-device losses."""

import json
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.sharding import workers
from tests.sharding.parity_worker import FAST_COMPILE
from tests.helpers import run
from tests.train.conftest import REPO, TEST_OVERRIDES, read_records, train_env
from tests.train.test_train_cli import COMPARED

LORA_STEPS = 8
ATTENTION_ONLY = "(dense_layers|moe_layers)/attn/(wq_a|wq_b|wkv_a|wkv_b|wo)"  # what a PEFT folder can carry
LORA = [f"--steps={LORA_STEPS}", "--config.optimizer.peak_lr=1e-2", "--config.optimizer.warmup_steps=2",
        "--config.train.eval_every=4", "--config.train.checkpoint_every=2"]


def lora_command(workdir, pretrained, *flags, cache_dir):
    """The LoRA command line (--config first: its overrides follow it) on the test-sized flags."""
    return [sys.executable, "-m", "experiments.train", "--config=experiments/configs/lora.py", f"--workdir={workdir}",
            f"--init_from={pretrained}", f"--config.train.compilation_cache={cache_dir}", *TEST_OVERRIDES, *LORA,
            *flags]


def run_lora(workdir, pretrained, *flags, cache_dir):
    cmd = lora_command(workdir, pretrained, *flags, cache_dir=cache_dir)
    result = run(cmd, train_env(), timeout=900)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def pretrained(uninterrupted):
    """The shrunk tiny model after the CLI tests' 60 steps of pretraining (its eval at the end)."""
    return uninterrupted[0]


@pytest.fixture(scope="module")
def lora_run(pretrained, tmp_path_factory, compile_cache):
    workdir = tmp_path_factory.mktemp("lora")
    result = run_lora(workdir, pretrained, f"--config.lora.targets={ATTENTION_ONLY}", cache_dir=compile_cache)
    return workdir, read_records(workdir), result.stderr


def test_lora_lowers_the_held_out_loss_and_trains_adapters_only(pretrained, lora_run):
    workdir, records, stderr = lora_run
    base_eval = read_records(pretrained)[-1]["eval_loss"]  # the same held-out batches
    assert [r["step"] for r in records] == list(range(1, LORA_STEPS + 1))
    assert records[-1]["eval_loss"] < base_eval - 0.01, (records[-1]["eval_loss"], base_eval)
    assert "LoRA rank 8 on 10 weights" in stderr  # 5 MLA projections x 2 layers
    with open(workdir / "config.json") as f:
        assert json.load(f)["lora"]["rank"] == 8


def test_lora_run_stopped_then_restarted_continues_exactly(pretrained, lora_run, tmp_path, compile_cache):
    _, reference, _ = lora_run
    cmd = lora_command(tmp_path, pretrained, f"--config.lora.targets={ATTENTION_ONLY}", cache_dir=compile_cache)
    proc = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert len(metrics.read_text().splitlines()) < LORA_STEPS, "the run ended before it could be stopped"

    result = run_lora(tmp_path, pretrained, f"--config.lora.targets={ATTENTION_ONLY}", cache_dir=compile_cache)
    assert "resumed from" in result.stderr
    resumed = read_records(tmp_path)
    assert [r["step"] for r in resumed] == list(range(1, LORA_STEPS + 1))
    for got, want in zip(resumed, reference):
        for key in (*COMPARED, "eval_loss"):
            if key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=f"step {got['step']} {key}")


def _mesh_losses(workdir, pretrained, devices: int, *mesh) -> list[float]:
    env = workers.fake_device_env(XLA_FLAGS="--xla_cpu_collective_timeout_seconds=900 "
                                  f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")
    out = workers.run(lora_command(workdir, pretrained, "--steps=2", "--config.train.eval_every=0",
                                   "--config.lora.experts=True", *mesh, cache_dir=""), env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [r["loss"] for r in read_records(workdir)]


def test_lora_on_a_mesh_equals_one_device(pretrained, tmp_path):
    one = _mesh_losses(tmp_path / "one", pretrained, 1)
    mesh = _mesh_losses(tmp_path / "mesh", pretrained, 8, "--config.mesh.data=1", "--config.mesh.fsdp=2",
                        "--config.mesh.expert=4")
    assert len(one) == 2
    assert mesh == pytest.approx(one, rel=1e-5)


def _convert(*args):
    out = run([sys.executable, "-m", "dsv3_jax.convert", "--to-hf", "--no-progress", *args], train_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_exports_load_in_transformers_and_peft_with_the_adapter_logits(pretrained, lora_run, tmp_path):
    """Merged export in transformers, and the adapter-only export through PeftModel on transformers'
    model of the base export: both give the logits of our model with its adapters (1e-4)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    from dsv3_jax.checkpoint import lora_export

    workdir, _, _ = lora_run
    _convert(f"--ckpt={pretrained}", f"--out={tmp_path / 'base'}")
    _convert(f"--ckpt={workdir}", f"--out={tmp_path / 'merged'}")
    _convert(f"--ckpt={workdir}", f"--out={tmp_path / 'peft'}", "--adapter_only", f"--base={tmp_path / 'base'}")
    model = lora_export.load_adapted(workdir, dtype="float32")
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 12))
    ours = np.asarray(model(tokens))

    def hf_logits(m):
        with torch.no_grad():
            return m(torch.from_numpy(tokens)).logits.numpy()

    load = dict(dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", **load)
    assert np.max(np.abs(hf_logits(base) - ours)) > 1e-3  # the adapters moved the model
    merged = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", **load))
    np.testing.assert_allclose(merged, ours, atol=1e-4 * np.max(np.abs(ours)), rtol=0)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    assert len([n for n, _ in adapted.named_parameters() if "lora_A" in n]) == 10  # 5 HF modules a layer
    np.testing.assert_allclose(hf_logits(adapted), ours, atol=1e-4 * np.max(np.abs(ours)), rtol=0)

    # ... and `--init_from=PEFT` (its base_model_name_or_path is the base export) builds our model again
    from experiments import train as train_lib
    from experiments.configs import lora as lora_config
    from dsv3_jax.train import finetune

    config = lora_config.get_config()
    config.train.init_from, config.lora.targets = str(tmp_path / "peft"), ATTENTION_ONLY
    again = train_lib.build_model(config, train_lib.model_config(config))
    mask = finetune.adapt(config, again)
    assert sum(jax.tree.leaves(mask)) == 2 * 10  # A and B of 10 stacked adapters
    np.testing.assert_allclose(np.asarray(again(tokens)), ours, atol=1e-4 * np.max(np.abs(ours)), rtol=0)

"""LoRA through its command line: `python -m experiments.train --config=experiments/configs/lora.py
--init_from=RUN` on a model pretrained here trains the adapters only,
resumes exactly after a stop, and on an fsdp=2 x expert=4 mesh gives the single-device losses."""

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
    result = run_lora(workdir, pretrained, "--config.lora.experts=True", cache_dir=compile_cache)
    return workdir, read_records(workdir), result.stderr


def test_lora_run_trains_the_adapters_and_leaves_the_base(pretrained, lora_run):
    """The run's checkpoint: base weights bit-equal to the pretrained run's, every adapter's B moved
    off its zero start. (Held-out loss: experiments/lora_figures.py, docs/lora.md; 8 steps of 256
    tokens are too few for a margin a test could hold.)"""
    from flax import nnx

    from dsv3_jax import load_pretrained
    from dsv3_jax.checkpoint.run_folder import StateParams, find

    workdir, records, stderr = lora_run
    assert [r["step"] for r in records] == list(range(1, LORA_STEPS + 1))
    assert "LoRA rank 8 on 19 weights" in stderr  # 5 MLA x 2 layers, dense MLP 3, shared 3, routed experts 3
    model = load_pretrained(workdir, dtype="float32")  # what generate and serve load: base + adapters
    bs = [v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.LoRAParam) and p[-1] == "b"]
    assert len(bs) == 19 and all(np.any(np.asarray(b[...]) != 0) for b in bs)
    before, after = StateParams(find(pretrained)), StateParams(find(workdir))
    for path in (("moe_layers", "attn", "wq_a"), ("moe_layers", "ffn", "w1"), ("dense_layers", "ffn", "w2")):
        np.testing.assert_array_equal(after.read(path), before.read(path))


def test_lora_run_stopped_then_restarted_continues_exactly(pretrained, lora_run, tmp_path, compile_cache):
    _, reference, _ = lora_run
    cmd = lora_command(tmp_path, pretrained, "--config.lora.experts=True", cache_dir=compile_cache)
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

    result = run_lora(tmp_path, pretrained, "--config.lora.experts=True", cache_dir=compile_cache)
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


def _convert(*args, code=0):
    out = run([sys.executable, "-m", "dsv3_jax.convert", "--to-hf", "--no-progress", *args], train_env(), timeout=600)
    assert out.returncode == code, out.stderr[-3000:]
    return out.stderr


def _close(got, want):
    np.testing.assert_allclose(got, want, atol=1e-4 * np.max(np.abs(want)), rtol=0)


def test_merged_export_loads_in_transformers_with_the_adapter_logits(lora_run, tmp_path):
    """Expert adapters included: transformers on the merged export = our model with its adapters."""
    torch = pytest.importorskip("torch")
    import transformers

    from dsv3_jax.checkpoint import lora_export

    workdir, _, _ = lora_run
    _convert(f"--ckpt={workdir}", f"--out={tmp_path / 'merged'}")
    model = lora_export.load_adapted(workdir, dtype="float32")
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 12))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        _close(hf(torch.from_numpy(tokens)).logits.numpy(), np.asarray(model(tokens)))
    err = _convert(f"--ckpt={workdir}", f"--out={tmp_path / 'peft'}", "--adapter_only", code=2)
    assert "moe_layers/ffn/w1" in err or "gate_proj" in err, err  # names what PEFT cannot carry


def test_adapter_only_export_loads_in_peft_and_back_as_init_from(pretrained, tmp_path, compile_cache):
    """An attention-only LoRA run: PeftModel over transformers' model of the base export gives our
    adapter model's logits, and `--init_from=` that PEFT folder builds the same model again."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    from dsv3_jax.checkpoint import lora_export
    from dsv3_jax.train import finetune
    from experiments import train as train_lib
    from experiments.configs import lora as lora_config

    workdir = tmp_path / "lora_attn"
    run_lora(workdir, pretrained, f"--config.lora.targets={ATTENTION_ONLY}", "--config.train.eval_every=0",
             cache_dir=compile_cache)
    _convert(f"--ckpt={pretrained}", f"--out={tmp_path / 'base'}")
    _convert(f"--ckpt={workdir}", f"--out={tmp_path / 'peft'}", "--adapter_only", f"--base={tmp_path / 'base'}")
    model = lora_export.load_adapted(workdir, dtype="float32")
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 12))
    ours = np.asarray(model(tokens))

    def hf_logits(m):
        with torch.no_grad():
            return m(torch.from_numpy(tokens)).logits.numpy()

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert np.max(np.abs(hf_logits(base) - ours)) > 1e-3  # the adapters moved the model
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    assert len([n for n, _ in adapted.named_parameters() if "lora_A" in n]) == 10  # 5 MLA modules a layer
    _close(hf_logits(adapted), ours)

    config = lora_config.get_config()
    config.train.init_from, config.lora.targets = str(tmp_path / "peft"), ATTENTION_ONLY
    again = train_lib.build_model(config, train_lib.model_config(config))
    mask = finetune.adapt(config, again)
    assert sum(jax.tree.leaves(mask)) == 2 * 10  # A and B of 10 stacked adapters
    _close(np.asarray(again(tokens)), ours)

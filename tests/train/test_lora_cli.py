"""LoRA through its command line: `python -m experiments.train --config=experiments/configs/lora.py
--init_from=RUN` on a model pretrained here (tests/train/conftest.py, the one pretraining the SFT and
pretraining CLI tests share) fine-tunes on the bundled chat set: the held-out SFT loss falls, only
the adapters train, router biases stay; on an fsdp=2 x expert=4 mesh it gives the single-device
losses; the exports load in transformers and peft; QLoRA (an int4 base, adapter dropout) trains
its adapters alone, resumes exactly from a checkpoint and exports merged. Exports run convert's
main in this process."""

import contextlib
import io
import json
import shutil
import sys

import jax
import numpy as np
import pytest

from tests.sharding import workers
from tests.sharding.parity_worker import FAST_COMPILE
from tests.helpers import run
from tests.train.conftest import TEST_OVERRIDES, read_records, train_env
from tests.train.test_train_cli import COMPARED

LORA_STEPS = 8
LORA = [f"--steps={LORA_STEPS}", "--config.data.seq_len=112", "--config.optimizer.peak_lr=1e-2",
        "--config.optimizer.warmup_steps=2", "--config.train.eval_every=4", "--config.train.checkpoint_every=2"]
DROPOUT_RUN = ["--config.lora.dropout=0.1"]  # the default targets (what a PEFT folder carries), adapter dropout
QLORA_RUN = ["--config.lora.base_weights=int4", *DROPOUT_RUN]  # the same over an int4 base


def lora_command(workdir, pretrained, *flags, cache_dir):
    """The LoRA command line (--config first: its overrides follow it) on the test-sized flags; rows
    of 112 tokens hold a bundled conversation."""
    return [sys.executable, "-m", "experiments.train", "--config=experiments/configs/lora.py", f"--workdir={workdir}",
            f"--init_from={pretrained}", f"--config.train.compilation_cache={cache_dir}", *TEST_OVERRIDES, *LORA,
            *flags]


def run_lora(workdir, pretrained, *flags, cache_dir):
    cmd = lora_command(workdir, pretrained, *flags, cache_dir=cache_dir)
    result = run(cmd, train_env(), timeout=900)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def lora_run(pretrained, tmp_path_factory, compile_cache):
    """Default targets plus the routed experts, with adapter dropout (routed rows' masks drawn in
    the grouped matmul)."""
    workdir = tmp_path_factory.mktemp("lora")
    result = run_lora(workdir, pretrained, "--config.lora.experts=True", "--config.lora.dropout=0.1",
                      cache_dir=compile_cache)
    return workdir, read_records(workdir), result.stderr


@pytest.fixture(scope="module")
def dropout_run(pretrained, tmp_path_factory, compile_cache):
    """The default targets (MLA, dense and shared MLPs: what PEFT carries), with adapter dropout."""
    workdir = tmp_path_factory.mktemp("lora_dropout")
    run_lora(workdir, pretrained, *DROPOUT_RUN, cache_dir=compile_cache)
    return workdir, read_records(workdir)


def test_lora_lowers_the_held_out_sft_loss_and_trains_the_adapters_only(pretrained, lora_run):
    """The held-out SFT loss (assistant tokens of the held-out bundled
    conversations) after 8 steps is below the pretrained model's (the step-0 record), the
    pretraining held-out loss reported beside it. The checkpoint: base weights and router biases
    bit-equal to the pretrained run's, every adapter's B moved off its zero start."""
    from flax import nnx

    from dsv3_jax import load_pretrained
    from dsv3_jax.checkpoint.run_folder import StateParams, find

    workdir, records, stderr = lora_run
    assert [r["step"] for r in records] == list(range(LORA_STEPS + 1))
    first, last = records[0], records[-1]
    assert {"eval_loss", "pretrain_eval_loss"} <= set(first) & set(last)
    assert last["eval_loss"] < first["eval_loss"] - 0.05, (first, last)
    assert stderr.count("LoRA rank 8 on 19 weights") == 1  # 5 MLA x 2 layers, dense MLP 3, shared 3, routed experts 3
    model = load_pretrained(workdir, dtype="float32")  # what generate and serve load: base + adapters
    bs = [v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.LoRAParam) and p[-1] == "b"]
    assert len(bs) == 19 and all(np.any(np.asarray(b[...]) != 0) for b in bs)
    before, after = StateParams(find(pretrained)), StateParams(find(workdir))
    for path in (("moe_layers", "attn", "wq_a"), ("moe_layers", "ffn", "w1"), ("dense_layers", "ffn", "w2")):
        np.testing.assert_array_equal(after.read(path), before.read(path))
    bias = ("moe_layers", "ffn", "gate", "bias")
    assert np.abs(before.read(bias)).max() > 0  # pretraining moved them; fine-tuning leaves them
    np.testing.assert_array_equal(after.read(bias), before.read(bias))


def _mesh_losses(workdir, pretrained, devices: int, *mesh) -> list[float]:
    """Two steps of expert LoRA on pretraining text rows of 32 tokens (the mesh is what is compared)."""
    env = workers.fake_device_env(XLA_FLAGS="--xla_cpu_collective_timeout_seconds=900 "
                                  f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}")
    out = workers.run(lora_command(workdir, pretrained, "--steps=2", "--config.train.eval_every=0",
                                   "--config.data.format=text", "--config.data.seq_len=32",
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
    """`python -m dsv3_jax.convert --to-hf ...` through its main in this process (no interpreter
    and jax start per export); returns what it printed to stderr."""
    from dsv3_jax import convert

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        got = convert.main(["--to-hf", "--no-progress", *map(str, args)])
    assert got == code, err.getvalue()[-3000:]
    return err.getvalue()


def _close(got, want):
    np.testing.assert_allclose(got, want, atol=1e-4 * np.max(np.abs(want)), rtol=0)


def test_merged_export_loads_in_transformers_with_the_adapter_logits(lora_run, tmp_path):
    """Expert adapters included: transformers on the merged export = our model with its adapters."""
    torch = pytest.importorskip("torch")
    import transformers

    from dsv3_jax.checkpoint import load_pretrained

    workdir, _, _ = lora_run
    _convert(f"--ckpt={workdir}", f"--out={tmp_path / 'merged'}")
    model = load_pretrained(workdir, dtype="float32")
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 12))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        _close(hf(torch.from_numpy(tokens)).logits.numpy(), np.asarray(model(tokens)))
    err = _convert(f"--ckpt={workdir}", f"--out={tmp_path / 'peft'}", "--adapter_only", code=2)
    assert "moe_layers/ffn/w1" in err or "gate_proj" in err, err  # names what PEFT cannot carry


def test_adapter_only_export_loads_in_peft_and_back_as_init_from(pretrained, dropout_run, tmp_path):
    """The dropout run (MLA, dense and shared-expert MLP adapters): PeftModel over transformers'
    model of the base export gives our adapter model's logits, the MLA adapters as target_modules and
    the MLPs' as target_parameters on exactly their weights (not the fused routed experts PEFT maps
    MLP names to), and `--init_from=` that PEFT folder builds the same model again."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    from dsv3_jax.checkpoint import load_pretrained
    from dsv3_jax.train import finetune, state as state_lib
    from dsv3_jax.train import loop as train_lib
    from experiments.configs import lora as lora_config

    workdir, _ = dropout_run
    _convert(f"--ckpt={pretrained}", f"--out={tmp_path / 'base'}")
    _convert(f"--ckpt={workdir}", f"--out={tmp_path / 'peft'}", "--adapter_only", f"--base={tmp_path / 'base'}")
    meta = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert meta["lora_dropout"] == 0.0  # PEFT's ParamWrapper (the MLP adapters) refuses another value
    assert sorted(p.split(".", 3)[-1] for p in meta["target_parameters"]) == [
        "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.shared_experts.down_proj.weight",
        "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight", "mlp.up_proj.weight"]
    model = load_pretrained(workdir, dtype="float32")
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 12))
    ours = np.asarray(model(tokens))

    def hf_logits(m):
        with torch.no_grad():
            return m(torch.from_numpy(tokens)).logits.numpy()

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert np.max(np.abs(hf_logits(base) - ours)) > 1e-3  # the adapters moved the model
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    wrapped = [n for n, _ in adapted.named_parameters() if "lora_A" in n]
    assert len(wrapped) == 16  # 5 MLA modules a layer, the dense MLP's 3, the shared expert's 3
    assert not [n for n in wrapped if ".experts." in n]  # nothing on the fused routed experts
    _close(hf_logits(adapted), ours)

    config = lora_config.get_config()
    config.train.init_from = str(tmp_path / "peft")
    again = train_lib.build_model(config, train_lib.model_config(config))
    finetune.adapt(config, again)
    mask = finetune.trainable(config, state_lib.split_model(again)[1])
    assert sum(jax.tree.leaves(mask)) == 2 * 16  # A and B of 16 stacked adapters
    _close(np.asarray(again(tokens)), ours)


def test_qlora_trains_adapters_over_an_int4_base_resumes_exactly_and_exports_merged(pretrained, tmp_path,
                                                                                     compile_cache):
    """`--config.lora.base_weights=int4` with adapter dropout 0.1: the held-out SFT loss falls; the
    checkpoint holds the base as int4 (packed q, scales) bit-equal to quantizing the pretrained
    weights, and optimizer state of exactly the adapters' size (measured on the stored arrays); cut
    back to its step-4 checkpoint, as a kill after step 4 leaves it, and restarted, the run repeats
    steps 5-8 (losses, gradient norms, held-out losses) exactly: the quantized base restored from
    its checkpoint, the dropout masks from the checkpointed train-state key; the merged export
    (dequantized base + s A B) loads in transformers with the adapter model's logits."""
    torch = pytest.importorskip("torch")
    import transformers

    from dsv3_jax import load_pretrained
    from dsv3_jax.checkpoint.run_folder import StateParams, find

    workdir = tmp_path / "qlora"
    run_lora(workdir, pretrained, *QLORA_RUN, cache_dir=compile_cache)
    records = read_records(workdir)
    assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 0.05, (records[0], records[-1])
    state = StateParams(find(workdir))
    base = load_pretrained(pretrained, dtype="float32", weights="int4", quantize="all")
    q = state.read(("moe_layers", "attn", "wq_a", "q"))
    assert q.dtype == np.uint8 and ("params", "moe_layers", "attn", "wq_a") not in state.keys
    np.testing.assert_array_equal(q, np.asarray(base.moe_layers.attn.wq_a[...].q))
    opt = [k for k in state.keys if k[0] == "opt_state" and k[-2].endswith("_lora")]
    adapters = [k for k in state.keys if k[0] == "params" and k[-2].endswith("_lora")]
    moments = sum(state.reader.read(k, ()).nbytes for k in opt)
    assert len(adapters) == 2 * 16 and moments == 2 * sum(state.read(k[1:]).nbytes for k in adapters)
    assert not [k for k in state.keys if k[0] == "opt_state" and {"mu", "nu"} & set(k) and not k[-2].endswith("_lora")]

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(workdir, resumed_dir)
    for step in (resumed_dir / "checkpoints").iterdir():
        if step.name.isdigit() and int(step.name) > 4:
            shutil.rmtree(step)
    result = run_lora(resumed_dir, pretrained, *QLORA_RUN, cache_dir=compile_cache)
    assert "resumed from" in result.stderr and "at step 4" in result.stderr
    resumed = read_records(resumed_dir)
    assert [r["step"] for r in resumed] == list(range(LORA_STEPS + 1))
    for got, want in zip(resumed[5:], records[5:]):
        for key in (*COMPARED, "eval_loss", "pretrain_eval_loss"):
            if key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=f"step {got['step']} {key}")

    _convert(f"--ckpt={workdir}", f"--out={tmp_path / 'merged'}")
    model = load_pretrained(workdir, dtype="float32")  # the int4 base (from --init_from) + the run's adapters
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 12))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        _close(hf(torch.from_numpy(tokens)).logits.numpy(), np.asarray(model(tokens)))

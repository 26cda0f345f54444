"""Chat fine-tuning through the command line, as a user runs it: a pretrained run (tests/train/conftest.py,
shared with the LoRA and pretraining CLI tests) -> SFT on the bundled chat set with experiments/configs/sft.py -> generate from the SFT run; a template that cannot mark
assistant turns exits 2 naming it."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import load_pretrained
from dsv3_jax.checkpoint import run_folder
from dsv3_jax.checkpoint.orbax_to_hf import export_run
from dsv3_jax.model.params import RouterBias
from dsv3_jax.serving.chat import BUNDLED_TEMPLATE
from tests.helpers import run_module
from tests.train.conftest import run_train, train_env

CONFIG = "experiments/configs/sft.py"
SFT = ["--config.data.seq_len=112", "--steps=4"]  # after TEST_OVERRIDES: rows that hold a conversation


@pytest.fixture(scope="module")
def sft_run(pretrained, tmp_path_factory, compile_cache):
    workdir = tmp_path_factory.mktemp("sft")
    result = run_train(workdir, *SFT, f"--init_from={pretrained}", cache_dir=compile_cache, config=CONFIG)
    assert "pretrain-eval" in result.stderr, result.stderr[-3000:]
    return workdir


def test_sft_reports_both_held_out_losses_from_step_0(sft_run):
    records = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and set(records[0]) == {"step", "eval_loss", "pretrain_eval_loss"}
    assert records[-1]["step"] == 4 and {"eval_loss", "pretrain_eval_loss", "loss"} <= set(records[-1])
    assert all(np.isfinite(r["pretrain_eval_loss"]) for r in (records[0], records[-1]))
    assert records[-1]["eval_loss"] < records[0]["eval_loss"]  # 4 steps on the chat set lower its held-out loss


def test_router_biases_are_frozen_and_the_weights_move(sft_run, pretrained):
    before, after = load_pretrained(pretrained), load_pretrained(sft_run)
    biases = [jax.tree.leaves(nnx.state(m, RouterBias)) for m in (before, after)]
    params = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (before, after)]
    assert biases[0] and any(np.abs(b).max() > 0 for b in biases[0])  # pretraining moved them
    for a, b in zip(*biases):
        np.testing.assert_array_equal(a, b)
    assert all(not np.array_equal(a, b) for a, b in zip(*params))


def test_generate_and_export_from_the_sft_run(sft_run, tmp_path):
    prompt = "<|bos|>User: What is 2 + 3?\n\nAssistant:"
    res = run_module("experiments.generate", f"--checkpoint={sft_run}", f"--prompt={prompt}", "--no_bos",
                     "--max_new_tokens=4", "--prefill_chunk=16", env=train_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith(prompt) and "tokens/s" in res.stdout
    export_run(run_folder.find(sft_run), str(tmp_path / "hf"), progress=False)
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == BUNDLED_TEMPLATE and config["eos_token"] == "<|eos|>"


def test_a_template_without_assistant_marks_exits_2_naming_it(tmp_path, compile_cache):
    plain = tmp_path / "plain.jinja"
    plain.write_text(BUNDLED_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    res = run_train(tmp_path / "run", *SFT, f"--config.data.chat_template={plain}", cache_dir=compile_cache,
                    check=False, config=CONFIG)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(plain) in last and "marks no assistant text" in last, last

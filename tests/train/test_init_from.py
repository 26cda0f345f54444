"""`--init_from`: training starts from a pretrained HF folder's weights (vocab matching the tokenizer)."""

import json
import os

import numpy as np
import pytest

from dsv3_jax import load_pretrained
from tests.helpers import shrunk_tiny_config
from tests.train.conftest import run_train

HF_CFG = shrunk_tiny_config(vocab_size=2048, num_mtp_layers=0)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tests.hf_reference import build_hf_model, save_hf

    folder = tmp_path_factory.mktemp("hf")
    save_hf(build_hf_model(HF_CFG, seed=5), str(folder))
    return folder


def test_build_model_takes_the_checkpoint_weights_and_the_config_policy(hf_folder):
    from experiments.configs.tiny import get_config
    from experiments.train import build_model, model_config

    config = get_config()
    config.train.init_from = str(hf_folder)
    config.model.compute_dtype = "bfloat16"
    model = build_model(config, model_config(config))
    ref = load_pretrained(hf_folder)
    assert model.config.hidden_size == 32 and model.config.compute_dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(model.embed[...]), np.asarray(ref.embed[...]))
    np.testing.assert_array_equal(np.asarray(model.moe_layers.ffn.w2[...]), np.asarray(ref.moe_layers.ffn.w2[...]))


def test_cli_trains_from_the_checkpoint(hf_folder, tmp_path, compile_cache):
    run_train(tmp_path, f"--init_from={hf_folder}", "--steps=2", cache_dir=compile_cache)
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in records] == [1, 2]
    # The HF weights (embedding std 1, O(1) logits) start far from a fresh init's ln(2048) = 7.62.
    assert abs(records[0]["lm_loss"] - np.log(2048)) > 0.5
    with open(tmp_path / "model_config.json") as f:
        assert json.load(f)["hidden_size"] == 32  # the checkpoint's architecture, recorded for resume

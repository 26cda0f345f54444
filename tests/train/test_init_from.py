"""`--init_from`: training starts from a pretrained HF folder's weights (vocab matching the tokenizer),
under the checkpoint's architecture and every run field of config.model (dsv3_jax/train/run_config.py)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax import load_pretrained
from dsv3_jax.train import run_config
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
    from dsv3_jax.train.loop import build_model, model_config

    config = get_config()
    config.train.init_from = str(hf_folder)
    config.model.compute_dtype = "bfloat16"
    model = build_model(config, model_config(config))
    ref = load_pretrained(hf_folder)
    assert model.config.hidden_size == 32 and model.config.compute_dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(model.embed[...]), np.asarray(ref.embed[...]))
    np.testing.assert_array_equal(np.asarray(model.moe_layers.ffn.w2[...]), np.asarray(ref.moe_layers.ffn.w2[...]))


# A value for each run field other than the tiny config's (and the checkpoint's) own.
CHANGED = {"param_dtype": "bfloat16", "compute_dtype": "bfloat16", "moe_impl": "dense", "moe_tile_size": 64,
           "attention_impl": "pallas", "fp8_matmul": True, "head_loss_impl": "full", "expert_capacity_factor": 1.25,
           "expert_exchange": "padded", "remat": True, "unroll_max_layers": 3, "pipeline_microbatches": 4,
           "pipeline_repeats": 2, "pipeline_schedule": "1f1b"}


def test_every_run_field_has_a_case():
    assert set(CHANGED) == set(run_config.RUN_FIELDS)


@pytest.mark.parametrize("field", run_config.RUN_FIELDS)
def test_init_from_honours_the_run_field(hf_folder, tmp_path, field):
    from experiments.configs.tiny import get_config
    from dsv3_jax.train.loop import resolve_model

    config = get_config()
    config.train.init_from = str(hf_folder)
    assert config.model[field] != CHANGED[field]
    config.model[field] = CHANGED[field]
    cfg, model = resolve_model(config, str(tmp_path), resume=False)
    assert getattr(cfg, field) == CHANGED[field] and model.config == cfg
    # The checkpoint's architecture, not config.model's (hidden_size 128 in the tiny config).
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_layers) == (HF_CFG.hidden_size, HF_CFG.vocab_size,
                                                                HF_CFG.num_layers)
    if field == "param_dtype":  # the weights themselves are stored in it
        assert model.embed[...].dtype == jnp.bfloat16 and model.moe_layers.ffn.w1[...].dtype == jnp.bfloat16


def test_cli_trains_from_the_checkpoint(hf_folder, tmp_path, compile_cache):
    run_train(tmp_path, f"--init_from={hf_folder}", "--steps=2", cache_dir=compile_cache)
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in records] == [1, 2]
    # The HF weights (embedding std 1, O(1) logits) start far from a fresh init's ln(2048) = 7.62.
    assert abs(records[0]["lm_loss"] - np.log(2048)) > 0.5
    with open(tmp_path / "model_config.json") as f:
        assert json.load(f)["hidden_size"] == 32  # the checkpoint's architecture, recorded for resume

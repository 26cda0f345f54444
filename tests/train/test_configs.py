"""The config presets build valid models; the 671B recipe is the paper's."""

import dataclasses
import importlib

import pytest

from dsv3_jax import ModelConfig


@pytest.mark.parametrize("name", ["tiny", "small", "deepseek_v3_671b"])
def test_presets_build_model_configs(name):
    c = importlib.import_module(f"experiments.configs.{name}").get_config()
    cfg = ModelConfig.from_dict(c.model.to_dict())
    assert set(c.model.keys()) == {f.name for f in dataclasses.fields(ModelConfig)}
    assert c.optimizer.b1 == 0.9 and c.optimizer.b2 == 0.95 and c.optimizer.weight_decay == 0.1
    assert c.optimizer.clip_norm == 1.0 and c.loss.mtp_weight == 0.3 and c.loss.balance_weight == 1e-4
    assert c.balancing.bias_update_speed == 1e-3
    if name == "tiny":
        assert cfg.vocab_size == 2048  # the bundled tokenizer


def test_671b_preset_is_the_released_architecture():
    c = importlib.import_module("experiments.configs.deepseek_v3_671b").get_config()
    cfg = ModelConfig.from_dict(c.model.to_dict())
    assert cfg == ModelConfig.deepseek_v3(yarn=None, max_position_embeddings=4096, remat=True)
    assert round(cfg.param_counts()["total"] / 1e9, 2) == 671.03
    assert c.optimizer.peak_lr == 2.2e-4 and c.optimizer.end_lr == 2.2e-5 and c.optimizer.final_lr == 7.3e-6


def test_dsa_stage_presets():
    """DSA's two stages: a dense warm-up (every key kept, only the indexer trains, router biases
    frozen) and the sparse stage (a quarter of the sequence per query, everything trains), both
    with the indexer's KL in the loss."""
    warm, sparse = (importlib.import_module(f"experiments.configs.dsa_{n}").get_config() for n in ("warmup", "sparse"))
    for c in (warm, sparse):
        assert ModelConfig.from_dict(c.model.to_dict()).has_indexer and c.loss.indexer_weight > 0
    assert warm.model.index_topk == warm.data.seq_len and warm.train.trainable == "indexer"
    assert warm.balancing.bias_update_speed == 0.0
    assert sparse.model.index_topk == sparse.data.seq_len // 4 and sparse.train.trainable == "all"

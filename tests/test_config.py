"""ModelConfig: presets, parameter counts against the paper and the abstract model, validation, HF I/O."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import ConfigError, DeepSeekV3, ModelConfig, YarnConfig

# The released config.json of deepseek-ai/DeepSeek-V3 (architecture fields), rope_scaling spelling.
RELEASED_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 10000, "max_position_embeddings": 163840,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def _n(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_671b_counts_match_the_paper():
    counts = ModelConfig.deepseek_v3().param_counts()
    assert round(counts["total"] / 1e9, 2) == 671.03
    assert 36.5e9 < counts["activated"] < 38e9  # "37B activated"
    assert round(counts["mtp"] / 1e9, 1) == 11.6
    # HF stores 684.5B: the MTP layer keeps its own copies of embedding and head.
    cfg = ModelConfig.deepseek_v3()
    hf_stored = counts["total"] + counts["mtp"] + 2 * cfg.vocab_size * cfg.hidden_size
    assert round(hf_stored / 1e9, 1) == 684.5


def test_671b_abstract_model_builds_without_allocating_and_matches_counts():
    cfg = ModelConfig.deepseek_v3()
    abstract = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    counts = cfg.param_counts()
    assert _n(state) == counts["total"] + counts["mtp"]
    assert _n(nnx.state(abstract.mtp)) == counts["mtp"]
    assert abstract.moe_layers.ffn.w1.shape == (58, 256, 7168, 2048)


@pytest.mark.parametrize("overrides", [
    dict(), dict(q_lora_rank=None), dict(num_dense_layers=0, num_layers=2), dict(num_mtp_layers=0),
    dict(num_mtp_layers=2, num_shared_experts=2), dict(num_dense_layers=3, num_layers=3),
])
def test_counts_equal_leaf_count_of_the_model(overrides):
    cfg = ModelConfig.tiny(**overrides)
    counts = cfg.param_counts()
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    assert _n(nnx.state(model)) == counts["total"] + counts["mtp"]


@pytest.mark.parametrize("overrides, field", [
    (dict(num_routed_experts=10, num_expert_groups=4), "num_expert_groups"),
    (dict(num_groups_per_token=5), "num_groups_per_token"),
    (dict(num_experts_per_token=9), "num_experts_per_token"),
    (dict(num_dense_layers=4), "num_dense_layers"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(num_expert_groups=16), "expert group"),
    (dict(compute_dtype="float64"), "compute_dtype"),
    (dict(moe_impl="loop"), "moe_impl"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(index_n_heads=4), "index_head_dim"),
    (dict(index_n_heads=4, index_head_dim=8, index_topk=16), "index_head_dim"),
    (dict(index_n_heads=4, index_head_dim=32, index_topk=16, q_lora_rank=None), "q_lora_rank"),
    (dict(index_topk=-1), "index_topk"),
    (dict(scale_fmt="e8m0"), "scale_fmt"),
])
def test_validation_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.tiny(**overrides)


def test_unknown_field_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"unknown ModelConfig field\(s\) \['hidden'\]"):
        ModelConfig.tiny().replace(hidden=3)
    with pytest.raises(ConfigError, match="n_experts"):
        ModelConfig.from_dict({**ModelConfig.tiny().to_dict(), "n_experts": 3})


def test_yarn_validation():
    with pytest.raises(ConfigError, match="yarn.factor"):
        YarnConfig(factor=0.0, original_max_position_embeddings=10)


def test_released_config_json_with_rope_scaling(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_CONFIG))
    cfg = ModelConfig.from_hf_config(tmp_path)
    ref = ModelConfig.deepseek_v3()
    for f in dataclasses.fields(ModelConfig):
        if f.name not in ("initializer_range",):
            assert getattr(cfg, f.name) == getattr(ref, f.name), f.name
    assert cfg.num_mtp_layers == 1 and cfg.yarn.factor == 40 and cfg.yarn.mscale_all_dim == 1.0


def test_transformers5_rope_parameters_and_null_q_lora():
    hf = {k: v for k, v in RELEASED_CONFIG.items() if k != "rope_scaling"}
    hf.update(q_lora_rank=None, rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 2048, "mscale": 0.5,
                                                 "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2})
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.q_lora_rank is None and cfg.rope_theta == 50000.0
    assert cfg.yarn == YarnConfig(factor=8.0, original_max_position_embeddings=2048, beta_fast=16, beta_slow=2,
                                  mscale=0.5, mscale_all_dim=1.0)
    plain = ModelConfig.from_hf_config({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.yarn is None


def test_to_hf_config_round_trips():
    for cfg in (ModelConfig.deepseek_v3(), ModelConfig.tiny(q_lora_rank=None, yarn=None, num_mtp_layers=0)):
        back = ModelConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config())))
        assert back.replace(param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype) == cfg


@pytest.mark.parametrize("key, value", [("hidden_act", "gelu"), ("scoring_func", "softmax"),
                                        ("tie_word_embeddings", True)])
def test_unsupported_hf_values_raise(key, value):
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf_config({**RELEASED_CONFIG, key: value})


def test_missing_hf_field_names_it():
    hf = {k: v for k, v in RELEASED_CONFIG.items() if k != "kv_lora_rank"}
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ModelConfig.from_hf_config(hf)


def test_softmax_scale_includes_yarn_mscale():
    cfg = ModelConfig.deepseek_v3()
    m = 0.1 * 1.0 * np.log(40.0) + 1.0
    assert np.isclose(cfg.softmax_scale, 192**-0.5 * m * m)
    assert np.isclose(cfg.replace(yarn=None).softmax_scale, 192**-0.5)


def test_a_run_saved_with_the_old_capacity_impl_name_still_loads():
    """Runs saved before the CPU padded-groups path was renamed carry moe_impl="capacity"."""
    saved = {**ModelConfig.tiny().to_dict(), "moe_impl": "capacity"}
    assert ModelConfig.from_dict(saved) == ModelConfig.tiny().replace(moe_impl="padded")
    with pytest.raises(ConfigError, match="moe_impl"):
        ModelConfig.tiny().replace(moe_impl="capacity")


# What DeepSeek-V3.1 and V3.2 add to V3's config.json (their release's inference configs:
# scale_fmt "ue8m0"; V3.2: 64 index heads of 128, top 2048).
V3_1_CONFIG = {**RELEASED_CONFIG, "quantization_config": {**RELEASED_CONFIG["quantization_config"], "scale_fmt": "ue8m0"}}
V3_2_CONFIG = {**V3_1_CONFIG, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
               "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}


def test_v3_1_and_v3_2_config_json_read_as_the_presets_and_write_back():
    for hf, preset in ((V3_1_CONFIG, ModelConfig.deepseek_v3_1()), (V3_2_CONFIG, ModelConfig.deepseek_v3_2())):
        cfg = ModelConfig.from_hf_config(hf)
        assert cfg.replace(initializer_range=preset.initializer_range) == preset
        out = {**preset.to_hf_config(), "quantization_config": preset.hf_quantization_config()}
        assert {k: out[k] for k in ("architectures", "model_type")} == {k: hf[k] for k in ("architectures", "model_type")}
        assert out["quantization_config"] == hf["quantization_config"]
        assert all(out[k] == hf[k] for k in ("index_n_heads", "index_head_dim", "index_topk") if k in hf)
        assert ModelConfig.from_hf_config(json.loads(json.dumps(out))) == preset.replace(param_dtype="float32")
    assert "index_topk" not in ModelConfig.deepseek_v3_1().to_hf_config()
    with pytest.raises(ConfigError, match="index_topk"):  # a V3.2 config.json that lacks one of its keys
        ModelConfig.from_hf_config({k: v for k, v in V3_2_CONFIG.items() if k != "index_topk"})


def test_an_indexer_config_round_trips_and_builds_its_indexer():
    cfg = ModelConfig.tiny(index_n_heads=2, index_head_dim=16, index_topk=8)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    back = ModelConfig.from_hf_config(cfg.to_hf_config())
    assert (back.index_n_heads, back.index_head_dim, back.index_topk) == (2, 16, 8)
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    assert model.moe_layers.attn.indexer.wq_b.shape == (cfg.num_moe_layers, cfg.q_lora_rank, 2, 16)


def test_indexer_parameter_count_matches_transformers_v32():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.tiny(index_n_heads=3, index_head_dim=24, index_topk=8, num_mtp_layers=0)
    with torch.device("meta"):
        hf = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**cfg.to_hf_config()))
    n = sum(p.numel() for p in hf.parameters())
    n += sum(b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
    assert n == cfg.param_counts()["total"]
    assert cfg.param_counts()["total"] - cfg.replace(index_n_heads=0, index_head_dim=0, index_topk=0).param_counts()[
        "total"] == cfg.num_layers * cfg.indexer_params() > 0

"""DeepSeek-V3.1 checkpoints: FP8 weights with power-of-two (UE8M0) block scales.

Reference: HF transformers' DeepseekV3ForCausalLM in fp32 on the weights dequantised here with
numpy (e4m3 x its block's power-of-two scale, exact), and numpy from DeepSeek's recipe: a block
scale is max(amax, 1e-4) / 448 rounded up to a power of two, for weights (128x128) and activations
(1x128). transformers 5.25 loads an FP8 folder on CPU by dequantising it itself, but takes the block
as rows // scale rows, so partial edge blocks (V3.1's 576-row kv_a_proj_with_mqa: 5 blocks) come
out wrong or refused; hence the numpy dequantisation.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv3_jax.checkpoint import load_pretrained
from dsv3_jax.checkpoint.safetensors_io import CheckpointError, HFCheckpoint, write_safetensors
from dsv3_jax.config import ModelConfig
from dsv3_jax.ops import linear, quant
from tests.checkpoint.conftest import convert
from tests.helpers import rel_err

# 200 = 128 + 72, 264, 136, 144, 160: most quantised matrices have several and partial blocks.
V31 = ModelConfig.tiny(vocab_size=300, hidden_size=200, intermediate_size=264, moe_intermediate_size=136,
                       num_layers=2, num_dense_layers=1, num_heads=2, q_lora_rank=144, kv_lora_rank=160,
                       qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48, num_routed_experts=8,
                       num_expert_groups=4, num_groups_per_token=2, num_experts_per_token=2, num_mtp_layers=0,
                       param_dtype="float32", compute_dtype="float32", scale_fmt="ue8m0")
TOKENS = np.random.default_rng(0).integers(0, V31.vocab_size, (2, 11)).astype(np.int32)
E4M3 = ml_dtypes.float8_e4m3fn


def ue8m0_scales(amax: np.ndarray) -> np.ndarray:
    """DeepSeek's V3.1 scale: max(amax, 1e-4) / 448, rounded up to a power of two (fp64 here)."""
    return 2.0 ** np.ceil(np.log2(np.maximum(amax.astype(np.float64), 1e-4) / 448.0))


def quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] -> (e4m3, fp32 scales per 128x128 block), partial edge blocks included."""
    rb, cb = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    amax = np.array([[np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max() for j in range(cb)]
                     for i in range(rb)])
    s = ue8m0_scales(amax)
    full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
    return (w / full).astype(E4M3), s.astype(np.float32)


def write_v31(src: str, out: str, scale_dtype=np.float32, tamper: bool = False, dequantised: str | None = None):
    """The HF folder `src` with its attention and MLP projections in e4m3 + UE8M0 scales; with
    `dequantised`, a second folder of the same weights dequantised (numpy, fp32)."""
    ckpt, tensors, plain = HFCheckpoint(src), {}, {}
    for name in ckpt.names():
        w = np.asarray(ckpt.read(name), np.float32)
        plain[name] = w
        if name.endswith("_proj.weight") and (".self_attn." in name or ".mlp." in name):
            q, s = quantize_blocks(w)
            plain[name] = (q.astype(np.float64) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
                           ).astype(np.float32)
            s[0, 0] *= 1.5 if tamper and "q_a_proj" in name else 1.0
            tensors[name], tensors[name + "_scale_inv"] = q, s.astype(scale_dtype)
        else:
            tensors[name] = w
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for folder, weights in ((dequantised, plain), (out, tensors)):  # the FP8 one with quantization_config
        if folder is not None:
            os.makedirs(folder)
            write_safetensors(os.path.join(folder, "model.safetensors"), weights)
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(config, f)
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}


@pytest.fixture(scope="module")
def v31(tmp_path_factory):
    """{"fp8": the V3.1-style folder, "logits": transformers' fp32 logits of it on TOKENS, "root"}."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.hf_reference import build_hf_model

    root = tmp_path_factory.mktemp("v31")
    build_hf_model(V31, seed=5).save_pretrained(root / "bf")
    write_v31(str(root / "bf"), str(root / "fp8"), dequantised=str(root / "deq"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        root / "deq", dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    with torch.no_grad():
        logits = ref(torch.from_numpy(TOKENS.astype(np.int64))).logits.float().numpy()
    return {"root": root, "fp8": root / "fp8", "logits": logits}


def test_v31_fp8_folder_matches_transformers(v31):
    model = load_pretrained(v31["fp8"], "float32")
    assert model.config.scale_fmt == "ue8m0"
    assert np.abs(v31["logits"]).max() > 1.0
    assert rel_err(model(TOKENS), v31["logits"]) <= 1e-4


def test_e8m0_stored_scales_load_as_the_fp32_ones(v31):
    write_v31(str(v31["root"] / "bf"), str(v31["root"] / "e8m0"), scale_dtype=ml_dtypes.float8_e8m0fnu)
    assert HFCheckpoint(v31["root"] / "e8m0").header("model.layers.0.self_attn.o_proj.weight_scale_inv")[1] == \
        np.dtype(ml_dtypes.float8_e8m0fnu)
    assert rel_err(load_pretrained(v31["root"] / "e8m0", "float32")(TOKENS), v31["logits"]) <= 1e-4


def test_a_scale_that_is_not_a_power_of_two_names_the_tensor(v31):
    write_v31(str(v31["root"] / "bf"), str(v31["root"] / "bad"), tamper=True)
    with pytest.raises(CheckpointError, match=r"q_a_proj.weight_scale_inv .* not a power of two.*ue8m0"):
        load_pretrained(v31["root"] / "bad", "float32")


def test_fp8_weights_keep_the_stored_scales_and_quantise_activations_ue8m0(v31):
    model = load_pretrained(v31["fp8"], "float32", weights="fp8")
    qa = model.dense_layers.attn.wq_a.value
    stored = HFCheckpoint(v31["fp8"]).read("model.layers.0.self_attn.q_a_proj.weight_scale_inv")
    assert qa.scale_fmt == "ue8m0" and np.array_equal(np.asarray(qa.scale[0]), stored)
    # One projection against numpy: x in 1x128 tiles with UE8M0 scales, times the stored weight.
    x = np.random.default_rng(1).normal(size=(5, V31.hidden_size)).astype(np.float32)
    w_q = np.asarray(qa.q[0]).astype(np.float64)
    w = w_q * np.repeat(np.repeat(stored.astype(np.float64), 128, 0), 128, 1)[:w_q.shape[0], :w_q.shape[1]]
    tiles = [x[:, j:j + 128] for j in range(0, x.shape[1], 128)]
    s = [ue8m0_scales(np.abs(t).max(axis=1, keepdims=True)) for t in tiles]
    x_deq = np.concatenate([(t / si).astype(E4M3).astype(np.float64) * si for t, si in zip(tiles, s)], axis=1)
    got = linear.project(jnp.asarray(x), qa[0], contract=1, compute_dtype="float32")
    assert rel_err(got, x_deq @ w.T) <= 1e-6


def test_keep_fp8_round_trip_keeps_scales_and_scale_fmt(v31, tmp_path):
    assert convert("--hf-dir", v31["fp8"], "--out", tmp_path / "ckpt", "--keep-fp8") == 0
    assert convert("--to-hf", "--fp8", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf") == 0
    src, back = HFCheckpoint(v31["fp8"]), HFCheckpoint(tmp_path / "hf")
    for name in src.names():
        if name.endswith("_scale_inv"):
            assert np.array_equal(np.asarray(src.read(name)), np.asarray(back.read(name))), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert ModelConfig.from_hf_config(config).scale_fmt == "ue8m0"


def test_quantising_to_fp8_under_ue8m0_makes_power_of_two_scales(v31, tmp_path):
    assert convert("--hf-dir", v31["fp8"], "--out", tmp_path / "ckpt", "--dtype", "float32") == 0
    assert convert("--to-hf", "--fp8", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf") == 0
    back = HFCheckpoint(tmp_path / "hf")
    src = HFCheckpoint(v31["root"] / "bf")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    q, s = np.asarray(back.read(name)), np.asarray(back.read(name + "_scale_inv"))
    assert np.all(np.frexp(s)[0] == 0.5)  # powers of two
    dequantised = q.astype(np.float64) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:q.shape[0], :q.shape[1]]
    w = np.asarray(src.read(name), np.float64)
    assert np.abs(dequantised - w).max() <= np.abs(w).max() / 8  # e4m3 keeps 3 mantissa bits


def test_weights_quantised_at_load_under_ue8m0_have_power_of_two_scales(v31):
    model = load_pretrained(v31["root"] / "bf", "float32", weights="fp8", scale_fmt="ue8m0")
    qa = model.moe_layers.ffn.w1.value
    assert qa.scale_fmt == "ue8m0" and np.all(np.frexp(np.asarray(qa.scale))[0] == 0.5)
    assert quant.dequantize(qa).shape == qa.shape

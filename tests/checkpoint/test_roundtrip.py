"""HF -> Orbax -> HF is bit-exact (bf16, fp32; FP8 with --keep-fp8 / --fp8), and what comes back
is what the model and HF transformers load."""

from __future__ import annotations

import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

from dsv3_jax.checkpoint import fp8, load_pretrained
from dsv3_jax.checkpoint.safetensors_io import HFCheckpoint
from tests.checkpoint.conftest import PARITY, convert


def assert_same_tensors(a_dir: str, b_dir: str) -> None:
    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        x, y = a.read(name), b.read(name)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert x.tobytes() == y.tobytes(), name


@pytest.mark.parametrize("tag", ["bf16", "fp32"])
def test_round_trip_bit_exact(hf_folders, tmp_path, tag):
    src = hf_folders[tag]
    assert convert("--hf-dir", src, "--out", tmp_path / "ckpt", "--verify") == 0
    assert convert("--to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf") == 0
    assert_same_tensors(src, tmp_path / "hf")
    assert HFCheckpoint(src).weight_map == HFCheckpoint(tmp_path / "hf").weight_map
    names = HFCheckpoint(tmp_path / "hf").names()
    assert "model.layers.3.eh_proj.weight" in names and "model.layers.3.embed_tokens.weight" in names
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 3


def test_fp8_keep_round_trip_reproduces_bytes_and_scales(hf_folders, tmp_path):
    src = hf_folders["fp8"]
    assert convert("--hf-dir", src, "--out", tmp_path / "ckpt", "--keep-fp8", "--verify") == 0
    assert os.path.isdir(tmp_path / "ckpt" / "fp8")
    assert convert("--to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf", "--fp8") == 0
    assert_same_tensors(src, tmp_path / "hf")
    a = HFCheckpoint(src)
    assert any(n.endswith("weight_scale_inv") for n in a.names())
    # Orbax alone reads every item back (its handlers named by the step metadata): the kept e4m3 bytes
    # and scales of the source, the config's format.
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as orbax:
        items = orbax.restore(tmp_path / "ckpt")
    expert = items["fp8"]["moe_layers"]["ffn"]["w2"]
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # moe_layers.ffn.w2[0, 3]
    assert np.asarray(expert["qvalue"][0, 3]).tobytes() == a.read(name).tobytes()
    np.testing.assert_array_equal(expert["scale_inv"][0, 3], a.read(name + "_scale_inv"))
    assert items["config"]["format"] == "dsv3_jax" and set(items["integrity"]["checksums"]) == {"params", "fp8"}
    # Kept FP8 and dequantised-at-conversion give the same model.
    assert convert("--hf-dir", src, "--out", tmp_path / "deq", "--dtype", "float32") == 0
    kept, deq = load_pretrained(tmp_path / "ckpt", dtype="float32"), load_pretrained(tmp_path / "deq")
    tokens = np.arange(20, dtype=np.int32).reshape(2, 10) % 96
    np.testing.assert_array_equal(np.asarray(kept(tokens)), np.asarray(deq(tokens)))


def test_export_fp8_from_unquantised_checkpoint(hf_folders, tmp_path):
    """--fp8 on a checkpoint without kept FP8 block-quantises the projections."""
    assert convert("--hf-dir", hf_folders["fp32"], "--out", tmp_path / "ckpt") == 0
    assert convert("--to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf", "--fp8") == 0
    q = HFCheckpoint(tmp_path / "hf")
    assert str(q.read("model.layers.1.mlp.experts.0.up_proj.weight").dtype) == "float8_e4m3fn"
    assert str(q.read("model.layers.1.mlp.gate.weight").dtype) == "float32"
    src = HFCheckpoint(hf_folders["fp32"])
    for name in ["model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"]:
        w = src.read(name)
        deq = fp8.dequantize(q.read(name), q.read(name.replace(".weight", ".weight_scale_inv")))
        assert np.abs(deq - w).max() <= 2**-4 * np.abs(w).max()  # e4m3: 3 mantissa bits
    load_pretrained(tmp_path / "hf")  # loads as an FP8 HF folder


def test_exported_folder_loads_in_transformers(tmp_path):
    """HF -> Orbax -> HF, then `from_pretrained` reproduces the golden HF logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src = os.path.join(PARITY, "all_moe_sharded")
    assert convert("--hf-dir", src, "--out", tmp_path / "ckpt") == 0
    assert convert("--to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf", "--shard-size", "100KB") == 0
    assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager", experts_implementation="eager").float().eval()
    golden = np.load(os.path.join(src, "golden.npz"))
    with torch.no_grad():
        logits = model(torch.from_numpy(golden["tokens"].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, golden["logits"], atol=1e-5 * np.abs(golden["logits"]).max())

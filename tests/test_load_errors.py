"""load_pretrained on broken HF folders: each error names the tensor and the file."""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from dsv3_jax import CheckpointError, ConfigError, load_pretrained
from dsv3_jax.checkpoint.fp8 import dequantize as dequantize_fp8
from dsv3_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors

SRC = os.path.join(os.path.dirname(__file__), "fixtures", "parity", "lora_groups_yarn")
NAME = "model.layers.1.self_attn.kv_b_proj.weight"


def _edit(tmp_path, change):
    folder = tmp_path / "hf"
    shutil.copytree(SRC, folder)
    path = folder / "model.safetensors"
    src = SafetensorsFile(path)
    tensors = {k: np.array(src.read(k)) for k in src.keys()}
    del src
    change(tensors)
    write_safetensors(path, tensors)
    return folder


def test_missing_tensor(tmp_path):
    folder = _edit(tmp_path, lambda t: t.pop(NAME))
    with pytest.raises(CheckpointError, match=rf"{NAME} is missing from .*hf"):
        load_pretrained(folder)


def test_unexpected_tensor(tmp_path):
    folder = _edit(tmp_path, lambda t: t.update({"model.layers.1.self_attn.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected .*model\.layers\.1\.self_attn\.extra\.weight .*model\.safetensors"):
        load_pretrained(folder)


def test_misshaped_tensor(tmp_path):
    folder = _edit(tmp_path, lambda t: t.update({NAME: t[NAME][:-1]}))
    with pytest.raises(CheckpointError, match=rf"{NAME} in .*model\.safetensors has shape \(127, 32\), the config needs \(128, 32\)"):
        load_pretrained(folder)


def test_wrongly_typed_tensor(tmp_path):
    folder = _edit(tmp_path, lambda t: t.update({NAME: t[NAME].astype(np.int32)}))
    with pytest.raises(CheckpointError, match=rf"{NAME} in .*model\.safetensors has dtype int32"):
        load_pretrained(folder)


def test_index_naming_a_missing_shard(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(os.path.join(os.path.dirname(SRC), "all_moe_sharded"), folder)
    os.remove(folder / "model-00003-of-00012.safetensors")
    with pytest.raises(CheckpointError, match="names shard model-00003-of-00012.safetensors"):
        load_pretrained(folder)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_pretrained(tmp_path)


def test_config_that_does_not_fit(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(SRC, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "n_group": 3}))
    with pytest.raises(ConfigError, match="num_expert_groups"):
        load_pretrained(folder)


def test_fp8_dequantisation_with_partial_edge_blocks(tmp_path):
    """A 200x300 weight (not multiples of 128) stored as e4m3 + ceil-sized scales loads as q * s."""
    rng = np.random.default_rng(0)
    q = rng.normal(0, 50, (200, 300)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2, (2, 3)).astype(np.float32)
    deq = dequantize_fp8(q, s)
    for i, j in [(0, 0), (127, 128), (128, 255), (199, 299), (150, 10)]:
        assert deq[i, j] == np.float32(q[i, j]) * s[i // 128, j // 128]


def test_fp8_checkpoint_loads_as_its_dequantised_weights(tmp_path):
    """Quantise kv_b_proj to e4m3 with block scales; loading equals loading the dequantised fp32."""
    rng = np.random.default_rng(1)
    holder = {}

    def quantise(t):
        w = t[NAME]
        s = rng.uniform(0.001, 0.01, (1, 1)).astype(np.float32)
        q = (w / s[0, 0]).astype(ml_dtypes.float8_e4m3fn)
        holder["deq"] = dequantize_fp8(q, s)
        t[NAME] = q
        t[NAME.replace(".weight", ".weight_scale_inv")] = s

    fp8 = load_pretrained(_edit(tmp_path / "a", quantise), dtype="float32")
    ref = load_pretrained(_edit(tmp_path / "b", lambda t: t.update({NAME: holder["deq"]})), dtype="float32")
    np.testing.assert_array_equal(np.asarray(fp8.moe_layers.attn.wkv_b[...]),
                                  np.asarray(ref.moe_layers.attn.wkv_b[...]))

"""Acceptance 4: every broken input fails with a message naming the tensor and the file, a
non-zero exit code, and no output (not even a temporary folder); a killed conversion leaves
nothing that loads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dsv3_jax.checkpoint import CheckpointError, load_pretrained
from dsv3_jax.checkpoint.safetensors_io import HFCheckpoint, write_safetensors
from benchmarks.make_synthetic_checkpoint import bench_config, make_checkpoint
from tests import helpers
from tests.checkpoint.conftest import convert

EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"


def _edit(src: str, dst, edit) -> str:
    """Copies HF folder `src` to `dst` with `edit(tensors: {name: array}, shard)` applied per shard."""
    ckpt = HFCheckpoint(src)
    os.makedirs(dst)
    weight_map = {}
    for shard, names in ckpt.iter_shards():
        tensors = {n: np.array(ckpt.read(n)) for n in names}
        edit(tensors, shard)
        write_safetensors(os.path.join(dst, shard), tensors)
        weight_map.update({n: shard for n in tensors})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    shutil.copy(os.path.join(src, "config.json"), dst)
    return ckpt.weight_map.get(EXPERT)


def _fails(tmp_path, folder, capsys, *words, flags=()):
    out = tmp_path / "out"
    assert convert("--hf-dir", folder, "--out", out, *flags) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)
    assert sorted(os.listdir(tmp_path)) == sorted(p for p in os.listdir(tmp_path) if p != "out"), "output left"
    assert not any(p.startswith("out") for p in os.listdir(tmp_path)), os.listdir(tmp_path)
    return err


def _drop(name):
    return lambda t, shard: t.pop(name, None)


CASES = {
    "missing": (_drop(EXPERT), [EXPERT, "model.safetensors.index.json", "missing"]),
    "unexpected": (lambda t, s: t.update({"model.layers.1.mlp.experts.99.up_proj.weight": t[EXPERT]})
                   if EXPERT in t else None, ["model.layers.1.mlp.experts.99.up_proj.weight", "unexpected", ".safetensors"]),
    "misshaped": (lambda t, s: t.update({EXPERT: t[EXPERT][:, :-1]}) if EXPERT in t else None,
                  [EXPERT, "shape", ".safetensors"]),
    "wrong_dtype": (lambda t, s: t.update({EXPERT: t[EXPERT].astype(np.int32)}) if EXPERT in t else None,
                    [EXPERT, "int32", ".safetensors"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_tensor(hf_folders, tmp_path, capsys, case):
    edit, words = CASES[case]
    src = tmp_path / "src"
    _edit(hf_folders["bf16"], src, edit)
    _fails(tmp_path, src, capsys, *words)


def test_fp8_missing_or_misshaped_scale(hf_folders, tmp_path, capsys):
    scale = EXPERT.replace(".weight", ".weight_scale_inv")
    _edit(hf_folders["fp8"], tmp_path / "a", _drop(scale))
    _fails(tmp_path, tmp_path / "a", capsys, EXPERT, scale, ".safetensors")
    _edit(hf_folders["fp8"], tmp_path / "b", lambda t, s: t.update({scale: np.ones((2, 2), np.float32)})
          if scale in t else None)
    _fails(tmp_path, tmp_path / "b", capsys, scale, "(2, 2)", ".safetensors")


def test_index_names_missing_shard(hf_folders, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(hf_folders["bf16"], src)
    shard = HFCheckpoint(src).weight_map[EXPERT]
    os.remove(src / shard)
    _fails(tmp_path, src, capsys, shard, "model.safetensors.index.json")


@pytest.mark.parametrize("field,value,words", [
    ("hidden_size", 48, ["model.embed_tokens.weight", "shape", "config.json"]),
    ("num_hidden_layers", 4, ["model.layers.3.", "unexpected", "config.json"]),
    ("qk_rope_head_dim", 16, ["self_attn", "shape", "config.json"]),
    ("n_routed_experts", 16, ["model.layers.1.mlp", "config.json"]),
])
def test_config_does_not_match_tensors(hf_folders, tmp_path, capsys, field, value, words):
    src = tmp_path / "src"
    shutil.copytree(hf_folders["bf16"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg[field] = value
    (src / "config.json").write_text(json.dumps(cfg))
    _fails(tmp_path, src, capsys, *words)


def test_existing_output_is_not_touched(hf_folders, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    assert convert("--hf-dir", hf_folders["bf16"], "--out", tmp_path / "out") == 2
    assert "already exists" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == ["keep"]


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_pretrained(tmp_path)


def test_kill_during_conversion_leaves_nothing_loadable(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_checkpoint(bench_config(12), str(src))  # ~200 MB: seconds to convert
    cmd = [sys.executable, "-m", "dsv3_jax.convert", "--hf-dir", str(src), "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = f"{out}.orbax-checkpoint-tmp-{proc.pid}"
    deadline = time.time() + 120
    while time.time() < deadline and not os.path.isdir(os.path.join(tmp, "params", "moe_layers.ffn.w1")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.isdir(tmp), "the conversion finished before it could be killed"
    assert not os.path.exists(out)
    for path in (out, tmp):
        with pytest.raises(CheckpointError):
            load_pretrained(path)
    # The next conversion removes the dead one's leftovers and succeeds.
    assert helpers.run(cmd).returncode == 0
    assert not os.path.exists(tmp)
    assert load_pretrained(out).config.num_layers == 12

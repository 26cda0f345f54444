"""Acceptance 1: HF -> Orbax -> load_pretrained gives HF transformers' logits (fp32), including a
config whose dims are not multiples of 128 with weights block-quantised to FP8 here (reference:
HF with the dequantised weights)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dsv3_jax.checkpoint import fp8, load_pretrained
from dsv3_jax.checkpoint.safetensors_io import HFCheckpoint, write_safetensors
from dsv3_jax.config import ModelConfig
from tests.checkpoint.conftest import PARITY, convert

FIXTURES = sorted(os.listdir(PARITY))


def close(got, want):
    assert np.abs(np.asarray(got) - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("name", FIXTURES)
def test_orbax_logits_match_hf(tmp_path, name):
    src = os.path.join(PARITY, name)
    assert convert("--hf-dir", src, "--out", tmp_path / "ckpt", "--dtype", "float32") == 0
    golden = np.load(os.path.join(src, "golden.npz"))
    model = load_pretrained(tmp_path / "ckpt")
    out = model.forward(golden["tokens"])
    close(out.logits, golden["logits"])
    t = golden["tokens"].shape[1]
    for k in range(1, model.config.num_mtp_layers + 1):  # depth k at i predicts t_{i+k+1}
        close(out.mtp_logits[k - 1][:, : t - k], golden[f"mtp_logits_{k}"])


# 200 = 128 + 72, 136, 264, 176 = 160 + 16: every quantised matrix has partial edge blocks.
ODD = ModelConfig.tiny(vocab_size=300, hidden_size=200, intermediate_size=264, moe_intermediate_size=136,
                       num_layers=2, num_dense_layers=1, num_heads=2, q_lora_rank=144, kv_lora_rank=160,
                       qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48, num_routed_experts=8,
                       num_expert_groups=4, num_groups_per_token=2, num_experts_per_token=2, num_mtp_layers=0,
                       param_dtype="float32", compute_dtype="float32")


def _quantise_folder(src: str, q_dir: str, deq_dir: str) -> int:
    """Writes the FP8 (released format) and the dequantised copy of an HF folder."""
    os.makedirs(q_dir), os.makedirs(deq_dir)
    ckpt, count = HFCheckpoint(src), 0
    for shard, names in ckpt.iter_shards():
        q_out, d_out = {}, {}
        for name in names:
            w = np.asarray(ckpt.read(name))
            if fp8.quantizable(name):
                q, s = fp8.quantize(w)
                assert s.shape == fp8.scale_shape(w.shape)
                q_out[name], q_out[name.replace(".weight", ".weight_scale_inv")] = q, s
                d_out[name] = fp8.dequantize(q, s)
                count += w.shape[0] % 128 != 0 or w.shape[1] % 128 != 0
            else:
                q_out[name] = d_out[name] = w
        write_safetensors(os.path.join(q_dir, shard), q_out)
        write_safetensors(os.path.join(deq_dir, shard), d_out)
    for f in os.listdir(src):
        if f.endswith(".json"):
            data = open(os.path.join(src, f)).read()
            for d in (q_dir, deq_dir):
                with open(os.path.join(d, f), "w") as out:
                    out.write(data)
    return count


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_fp8_odd_dims_match_hf_on_dequantised_weights(tmp_path, keep_fp8):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import transformers

    from tests.hf_reference import build_hf_model

    build_hf_model(ODD).save_pretrained(tmp_path / "hf")
    partial = _quantise_folder(str(tmp_path / "hf"), str(tmp_path / "fp8"), str(tmp_path / "deq"))
    assert partial > 5
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "deq", attn_implementation="eager", experts_implementation="eager").float().eval()
    tokens = np.random.default_rng(0).integers(0, ODD.vocab_size, (2, 11))
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).logits.numpy()
    flags = ["--keep-fp8"] if keep_fp8 else []
    assert convert("--hf-dir", tmp_path / "fp8", "--out", tmp_path / "ckpt", "--dtype", "float32", *flags) == 0
    assert os.path.isdir(tmp_path / "ckpt" / "fp8") == keep_fp8
    close(load_pretrained(tmp_path / "ckpt")(tokens.astype(np.int32)), want)


def test_mtp_copy_mismatch_warns(hf_folders, tmp_path, caplog):
    src = HFCheckpoint(hf_folders["bf16"])
    folder = tmp_path / "hf"
    os.makedirs(folder)
    for shard, names in src.iter_shards():
        tensors = {n: np.array(src.read(n)) for n in names}
        if "model.layers.3.embed_tokens.weight" in tensors:
            tensors["model.layers.3.embed_tokens.weight"][0, 0] += 1
        write_safetensors(folder / shard, tensors)
    for f in ("config.json", "model.safetensors.index.json"):
        (folder / f).write_text(open(os.path.join(hf_folders["bf16"], f)).read())
    with caplog.at_level("WARNING"):
        assert convert("--hf-dir", folder, "--out", tmp_path / "ckpt") == 0
    assert "model.layers.3.embed_tokens.weight" in caplog.text and "differs" in caplog.text
    # Per process: each of 2 processes compares half the rows; only the one holding row 0 sees it.
    from dsv3_jax.checkpoint.hf_reader import HFReader

    whole = HFReader(folder)
    whole.compare_mtp_copies(whole.config())
    for part, warns in (((0, 2), True), ((1, 2), False)):
        caplog.clear()
        reader = HFReader(folder)
        with caplog.at_level("WARNING"):
            reader.compare_mtp_copies(reader.config(), part=part)
        assert ("differs" in caplog.text) == warns, part
        assert 2 * reader.bytes_read == whole.bytes_read

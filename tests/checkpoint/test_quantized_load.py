"""load_pretrained(weights=...): FP8 kept as stored and run through the block-scaled matmul; int8 /
int4 quantized per shard as they load, the forward equal to one on numpy-dequantized weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import load_pretrained
from dsv3_jax.checkpoint.safetensors_io import HFCheckpoint
from dsv3_jax.model import DeepSeekV3
from dsv3_jax.model import quant as model_quant
from tests.helpers import rel_err
from tests.model.test_quant import np_dequantize, np_quantize

TOKENS = np.random.default_rng(0).integers(0, 96, (2, 12))
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"  # moe_layers.ffn.w2[0, 3]


def _logits(model):
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS)))


def _array_bytes(model) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(nnx.state(model)))


def test_fp8_load_keeps_the_stored_blocks(hf_folders):
    """Acceptance 1: <= 55% of the bf16 load's bytes, the e4m3 values and scales as stored, logits
    those of the dequantized weights through the FP8 recipe (same 1x128 activation tiles)."""
    folder = hf_folders["fp8"]
    bf16 = load_pretrained(folder)
    model = load_pretrained(folder, weights="fp8", compute_dtype="float32")
    ratio = _array_bytes(model) / _array_bytes(bf16)
    print(f"fp8 load holds {ratio:.3f} of the bf16 load's parameter bytes")
    assert ratio <= 0.55
    w2 = model.moe_layers.ffn.w2[...]
    stored = HFCheckpoint(folder)
    np.testing.assert_array_equal(np.asarray(w2.q[0, 3]).view(np.uint8), stored.read(EXPERT).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(w2.scale[0, 3]), stored.read(EXPERT + "_scale_inv"))
    logits = _logits(model)
    cfg = model.config.replace(fp8_matmul=True, param_dtype="float32")
    reference = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    nnx.update(reference, nnx.state(model_quant.dequantize_model(model, jnp.float32)))
    # The two forwards agree to fp32 rounding (~2e-7) before each layer quantizes its activations to
    # e4m3, where a value at a rounding midpoint can go either way and move its position's logits by
    # one e4m3 step (~1e-2; one of the 24 positions under jax 0.12.1's XLA): every other position equal.
    want = _logits(reference)
    per_position = np.abs(logits - want).max(-1) / np.abs(want).max()
    assert np.sum(per_position >= 1e-5) <= 1 and per_position.max() < 5e-2, per_position


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int_load_equals_numpy_reference(hf_folders, fmt):
    """Acceptance 2: every projection quantized per shard (group 16); the values equal numpy's
    quantization of the stored tensor, and the fp32 forward equals the plain forward on the
    weights numpy dequantizes from the loaded arrays."""
    folder = hf_folders["fp32"]
    model = load_pretrained(folder, weights=fmt, quantize="all", quant_group=16)
    w2 = model.moe_layers.ffn.w2[...]
    q_ref, _ = np_quantize(HFCheckpoint(folder).read(EXPERT).T, fmt, 16)
    np.testing.assert_array_equal(np_dequantize(w2)[0, 3] != 0, q_ref != 0)
    np.testing.assert_array_equal(np.rint(np_dequantize(w2)[0, 3] / np.repeat(np.asarray(w2.scale[0, 3]), 16, 0)),
                                  q_ref)
    logits = _logits(model)
    reference = load_pretrained(folder)
    for path, module, name, _ in model_quant.targets(model, "all"):
        qa = getattr(module, name)[...]
        target = reference
        for p in path:
            target = getattr(target, p)
        target.set_value(jnp.asarray(np_dequantize(qa).reshape(qa.shape), jnp.float32))
    assert rel_err(logits, _logits(reference)) < 1e-4


def test_bad_weights_argument_names_it(hf_folders):
    with pytest.raises(ValueError, match="weights='int3'"):
        load_pretrained(hf_folders["fp32"], weights="int3")
    with pytest.raises(ValueError, match="quantize='some'"):
        load_pretrained(hf_folders["fp32"], weights="int8", quantize="some")


@pytest.mark.parametrize("fmt, source", [("int4", "fp32"), ("fp8", "bf16")])
def test_convert_quantize_writes_what_load_quantizes(hf_folders, tmp_path, fmt, source):
    """`convert --quantize` stores per block what `load_pretrained(weights=...)` builds per shard
    from the HF folder (bf16 quantized to FP8 blocks; int4 packed with its group scales); the
    checkpoint loads quantized by default, and another int format is refused by name."""
    from tests.checkpoint.conftest import convert

    out = tmp_path / "ckpt"
    assert convert("--hf-dir", hf_folders[source], "--out", out, f"--quantize={fmt}", "--quant-targets=all",
                   "--quant-group=16") == 0
    direct = load_pretrained(hf_folders[source], weights=fmt, quantize="all", quant_group=16)
    stored = load_pretrained(out)
    assert model_quant.format_of(stored) == fmt
    for path, module, name, _ in model_quant.targets(direct, "all"):
        want = getattr(module, name)[...]
        got = stored
        for p in path:
            got = getattr(got, p)
        got = got[...]
        np.testing.assert_array_equal(np.asarray(got.q).view(np.uint8), np.asarray(want.q).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
    if fmt == "int4":
        with pytest.raises(Exception, match="holds int4 weights"):
            load_pretrained(out, weights="int8")


def test_quantized_loads_on_a_mesh(hf_folders):
    """8 fake devices, fsdp=2 x expert=4: each shard of q and scale built where it lives; logits as
    on one device (tests/checkpoint/_quant_mesh.py)."""
    from tests.helpers import run_module
    from tests.sharding import workers

    res = run_module("tests.checkpoint._quant_mesh", hf_folders["fp8"], hf_folders["fp32"],
                     env=workers.fake_device_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("rel err") == 3, res.stdout

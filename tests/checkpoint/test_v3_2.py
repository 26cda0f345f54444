"""DeepSeek-V3.2: the lightning indexer and sparse attention against transformers'
DeepseekV32ForCausalLM (fp32, index_topk 16, sequences shorter and longer than it), HF folders
both ways, and the sparse forward below index_topk equal to the dense one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax.checkpoint import load_pretrained
from dsv3_jax.checkpoint.safetensors_io import HFCheckpoint
from dsv3_jax.config import ModelConfig
from dsv3_jax.model.attention import LatentCache
from dsv3_jax.model.rope import rope_angles
from dsv3_jax.model.transformer import DeepSeekV3
from tests.checkpoint.conftest import convert, tiny_cfg
from tests.checkpoint.test_roundtrip import assert_same_tensors

TOPK = 16
V32 = tiny_cfg(num_layers=2, num_mtp_layers=0, param_dtype="float32", index_n_heads=8, index_head_dim=32,
               index_topk=TOPK)
TOKENS = np.random.default_rng(0).integers(0, V32.vocab_size, (2, 40)).astype(np.int32)
LENGTHS = (TOPK // 2, 40)
N = 24  # the hook's length: past index_topk  # below index_topk: dense attention; above: each query keeps 16 keys


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """{"folder": transformers' save_pretrained of a DeepseekV32ForCausalLM, "hf": the model,
    "model": ours loaded from the folder, length: HF's fp32 logits of TOKENS[:, :length]}."""
    pytest.importorskip("torch")
    from tests.hf_reference import build_hf_model, hf_logits

    folder = tmp_path_factory.mktemp("v32") / "hf"
    hf = build_hf_model(V32, seed=3)
    hf.save_pretrained(folder)
    out = {"folder": folder, "hf": hf, "model": load_pretrained(folder, "float32")}
    return out | {t: hf_logits(hf, TOKENS[:, :t]) for t in LENGTHS}


@pytest.mark.parametrize("length", LENGTHS)
def test_v32_logits_match_transformers(v32, length):
    assert v32["model"].config.index_topk == TOPK
    assert np.abs(v32[length]).max() > 1.0
    assert np.abs(np.asarray(v32["model"](TOKENS[:, :length])) - v32[length]).max() <= 1e-4


def test_the_selection_matters_past_index_topk(v32):
    """The same weights attending densely (index_topk >= length) give other logits past 16 tokens:
    the parity above checks the selection, not dense attention."""
    dense = load_pretrained(v32["folder"], "float32", index_topk=64)
    assert np.abs(np.asarray(dense(TOKENS)) - v32[40]).max() > 1e-2


def _first_attn(model):
    """The first dense layer's MLA, out of its stack."""
    graphdef, state = nnx.split(model.dense_layers.attn)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))


def _inputs(length: int):
    x = jnp.asarray(0.1 * np.random.default_rng(1).normal(size=(2, length, V32.hidden_size)), jnp.float32)  # no exp underflows to 0
    return (x, *rope_angles(jnp.broadcast_to(jnp.arange(length), (2, length)), V32))


def test_below_index_topk_sparse_equals_dense_exactly(v32):
    """A query with at most index_topk keys keeps all of them: the V3.2 model equals, bit for bit,
    the dense model (index fields 0, no indexer) on the same weights below index_topk tokens; past
    it, its MLA (the indexer run, its selection masking the scores) equals the dense MLA exactly on
    the first index_topk queries and differs after."""
    sparse = v32["model"]
    dense_cfg = sparse.config.replace(index_n_heads=0, index_head_dim=0, index_topk=0)
    dense = nnx.eval_shape(lambda: DeepSeekV3(dense_cfg, rngs=nnx.Rngs(0)))  # every value replaced below
    state = nnx.state(sparse)
    for stack in ("dense_layers", "moe_layers"):
        del state[stack]["attn"]["indexer"]
    nnx.update(dense, state)
    short = TOKENS[:, :TOPK]
    np.testing.assert_array_equal(np.asarray(sparse(short)), np.asarray(dense(short)))
    x, cos, sin = _inputs(N)
    out = np.asarray(_first_attn(sparse).expanded(x, cos, sin, indexer_terms=True)[0])
    want = np.asarray(_first_attn(dense).expanded(x, cos, sin))
    np.testing.assert_array_equal(out[:, :TOPK], want[:, :TOPK])
    assert np.all(np.abs(out[:, TOPK:] - want[:, TOPK:]).max(axis=-1) > 0)


def test_indexer_terms_hook(v32):
    """MLA's hook for training the indexer: the forward unchanged, the indexer's causal logits and
    the main attention's probabilities summed over heads, over min(t + 1, index_topk) keys; the
    cached path refuses a V3.2 model."""
    attn, (x, cos, sin) = _first_attn(v32["model"]), _inputs(N)
    out, terms = attn.expanded(x, cos, sin, indexer_terms=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(attn.expanded(x, cos, sin)))
    logits, probs = np.asarray(terms.logits), np.asarray(terms.attn_probs)
    assert logits.shape == probs.shape == (2, N, N)
    above = np.triu(np.ones((N, N), bool), 1)
    assert np.all(np.isneginf(logits[:, above])) and np.all(np.isfinite(logits[:, ~above]))
    np.testing.assert_allclose(probs.sum(-1), V32.num_heads, rtol=1e-5)
    kept = (probs > 0).sum(-1)  # keys attended per query
    np.testing.assert_array_equal(kept, np.broadcast_to(np.minimum(np.arange(1, N + 1), TOPK), (2, N)))
    with pytest.raises(ValueError, match="Sparse Attention through the latent cache .* not built yet"):
        z = jnp.zeros((2, N, V32.kv_lora_rank))
        attn(x[:, :1], cos[:, :1], sin[:, :1], cache=LatentCache(z, None, z[..., :V32.qk_rope_head_dim]),
             positions=jnp.zeros((2, 1), jnp.int32))


def test_generate_refuses_a_v32_folder_in_one_line(v32, capsys):
    """Until sparse attention runs through the cache, generate (and serve, by the same check) exits
    2 naming the reason instead of decoding densely."""
    from dsv3_jax.data.chat import BUNDLED_CHAT_PATH
    from experiments import generate

    tokenizer = BUNDLED_CHAT_PATH.parent / "tokenizer.json"  # the bundled one
    assert generate.main([f"--checkpoint={v32['folder']}", f"--tokenizer={tokenizer}", "--prompt=hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: index_n_heads=8: DeepSeek Sparse Attention through the latent cache")


def test_v32_round_trip_through_our_checkpoint_loads_in_transformers(v32, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.hf_reference import hf_logits

    assert convert("--hf-dir", v32["folder"], "--out", tmp_path / "ckpt") == 0
    assert convert("--to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf") == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                             experts_implementation="eager").float().eval()
    assert type(back).__name__ == "DeepseekV32ForCausalLM"
    np.testing.assert_array_equal(hf_logits(back, TOKENS), v32[40])


def test_v32_fp8_folder_with_mtp_round_trips_bit_exact(tmp_path):
    """A hub-shaped V3.2 folder (FP8 indexer wq_b / wk with their scales, an MTP layer that has its
    own indexer) -> ours (--keep-fp8) -> HF gives back the same bytes."""
    from benchmarks.make_synthetic_checkpoint import make_checkpoint

    cfg = tiny_cfg(index_n_heads=2, index_head_dim=32, index_topk=4)
    make_checkpoint(cfg, tmp_path / "src", use_fp8=True, seed=1)
    names = HFCheckpoint(tmp_path / "src").names()
    assert "model.layers.3.self_attn.indexer.wq_b.weight_scale_inv" in names  # the MTP layer's
    assert "model.layers.0.self_attn.indexer.weights_proj.weight_scale_inv" not in names
    assert convert("--hf-dir", tmp_path / "src", "--out", tmp_path / "ckpt", "--keep-fp8") == 0
    assert convert("--to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf", "--fp8") == 0
    assert_same_tensors(tmp_path / "src", tmp_path / "hf")
    assert ModelConfig.from_hf_config(tmp_path / "hf").index_topk == 4

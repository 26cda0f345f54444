"""load_pretrained(PEFT folder): a folder that peft itself saved (a `PeftModel` over transformers'
DeepseekV3 with random A and B, on attention modules of some layers and on MLP weights) loads over
its base with adapters exactly where the folder has them and gives PeftModel's logits, and
`experiments.generate --checkpoint=PEFT_FOLDER` continues a prompt as PeftModel's greedy `generate`
does; over a base held int8 the adapters are the same; `base=` stands in for a base_model_name_or_path that is no local folder; routed-expert
adapters (per-expert modules) add s B A to exactly their expert; what we cannot load is refused by name."""

import json
import shutil

import numpy as np
import pytest

from dsv3_jax import load_pretrained
from dsv3_jax.checkpoint import CheckpointError
from dsv3_jax.checkpoint.safetensors_io import HFCheckpoint, write_safetensors
from dsv3_jax.config import ModelConfig

# The bundled tokenizer's 2048 ids, so the generate CLI runs on it; no MTP (transformers has none).
CFG = ModelConfig.tiny(vocab_size=2048, num_mtp_layers=0, param_dtype="float32")
TOKENS = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 12))
ATTN = ["q_a_proj", "kv_b_proj", "o_proj"]
MLP = ["model.layers.0.mlp.gate_proj.weight", "model.layers.2.mlp.shared_experts.down_proj.weight"]


def _close(got, want):
    np.testing.assert_allclose(got, want, atol=1e-4 * np.max(np.abs(want)), rtol=0)


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(base HF folder, PEFT folder, the PeftModel, its logits on TOKENS)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    from tests.hf_reference import build_hf_model

    root = tmp_path_factory.mktemp("peft")
    build_hf_model(CFG).save_pretrained(root / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32,
                                                           attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        base_logits = hf(torch.from_numpy(TOKENS)).logits.numpy()
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=ATTN, layers_to_transform=[0, 2], target_parameters=MLP,
                             init_lora_weights=False)  # random B too: the adapters move the logits
    model = peft.get_peft_model(hf, config).eval()
    model.save_pretrained(root / "adapter")
    with torch.no_grad():
        logits = model(torch.from_numpy(TOKENS)).logits.numpy()
    assert np.abs(logits - base_logits).max() > 0.1 * np.abs(base_logits).max()
    return root / "base", root / "adapter", model, logits


def _adapters(model) -> dict:
    from flax import nnx

    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.LoRAParam)}


def test_peft_folder_loads_over_its_base_with_peft_logits(adapted):
    base, folder, _, want = adapted
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    model = load_pretrained(folder)
    _close(np.asarray(model(TOKENS)), want)
    adapters = _adapters(model)
    assert {p.rsplit("/", 1)[0] for p in adapters} == {
        "dense_layers/attn/wq_a_lora", "dense_layers/attn/wkv_b_lora", "dense_layers/attn/wo_lora",
        "moe_layers/attn/wq_a_lora", "moe_layers/attn/wkv_b_lora", "moe_layers/attn/wo_lora",
        "dense_layers/ffn/w1_lora", "moe_layers/ffn/shared_experts/w2_lora"}
    # HF layer 1 (moe_layers[0]) is outside layers_to_transform: its adapter adds nothing
    assert not np.any(adapters["moe_layers/attn/wq_a_lora/b"][0])
    assert np.all(adapters["moe_layers/attn/wq_a_lora/b"][1] != 0)
    # QLoRA inference: the base held int8, the same fp32 adapters read onto it
    from dsv3_jax.model import quant as model_quant

    quantized = load_pretrained(folder, weights="int8", quantize="all")
    assert model_quant.format_of(quantized) == "int8"
    for path, value in _adapters(quantized).items():
        np.testing.assert_array_equal(value, adapters[path], err_msg=path)


def test_generate_cli_on_a_peft_folder_continues_as_peft_does(adapted, capsys):
    import torch

    from dsv3_jax.data import load_tokenizer
    from experiments import generate

    _, folder, peft_model, _ = adapted
    prompt, new = "The man said", 6
    tokenizer = load_tokenizer(None)  # the bundled one: neither folder has a tokenizer.json
    ids, _ = generate.encode_prompts(tokenizer, [prompt], bos=True)
    with torch.no_grad():
        theirs = peft_model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=int),
                                     max_new_tokens=new, do_sample=False, eos_token_id=None)
    continuation = tokenizer.decode(theirs[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    assert generate.main([f"--checkpoint={folder}", f"--prompt={prompt}", f"--max_new_tokens={new}"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(prompt + continuation + "\nprefill "), (printed, theirs.tolist())


def test_base_argument_and_unloadable_folders(adapted, tmp_path):
    base, folder, _, want = adapted
    moved = tmp_path / "adapter"
    shutil.copytree(folder, moved)
    meta = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**meta, "base_model_name_or_path": "deepseek-ai/V3"}))
    with pytest.raises(CheckpointError, match=r"'deepseek-ai/V3', which is no local folder: pass base="):
        load_pretrained(moved)
    _close(np.asarray(load_pretrained(moved, base=base)(TOKENS)), want)  # as PeftModel.from_pretrained(base, moved)
    with pytest.raises(ValueError, match="base=.* is the base model of a PEFT adapter folder"):
        load_pretrained(base, base=base)
    (moved / "adapter_config.json").write_text(json.dumps({**meta, "rank_pattern": {"o_proj": 8}}))
    with pytest.raises(CheckpointError, match="rank_pattern=.* is not supported"):
        load_pretrained(moved)
    (moved / "adapter_config.json").write_text(json.dumps(meta))
    tensors = {k: np.array(v) for k, v in _read(moved / "adapter_model.safetensors").items()}
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, CFG.hidden_size), np.float32)
    write_safetensors(moved / "adapter_model.safetensors", tensors)
    with pytest.raises(CheckpointError, match="adapter on lm_head, which is not a projection"):
        load_pretrained(moved)


def _read(path) -> dict:
    from dsv3_jax.checkpoint.safetensors_io import SafetensorsFile

    f = SafetensorsFile(path)
    return {k: f.read(k) for k in f.keys()}


def test_routed_expert_adapters_add_to_their_expert_only(adapted, tmp_path):
    """A folder with per-expert modules (as transformers wrote DeepseekV3 before it fused the
    experts): loaded, the model equals its base with s B A added by numpy to that expert's HF weights."""
    base, _, _, _ = adapted
    rng = np.random.default_rng(1)
    r, alpha, d, f = 2, 6.0, CFG.hidden_size, CFG.moe_intermediate_size
    expert = "model.layers.1.mlp.experts.3"
    shapes = {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
    adapters = {proj: (rng.standard_normal((r, i)).astype(np.float32), rng.standard_normal((o, r)).astype(np.float32))
                for proj, (o, i) in shapes.items()}
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                            "base_model_name_or_path": str(base)}))
    write_safetensors(folder / "adapter_model.safetensors", {f"base_model.model.{expert}.down_proj.lora_{n}.weight": m
                                                             for n, m in zip("AB", adapters["down_proj"])})
    with pytest.raises(CheckpointError, match=r"adapts the routed experts' \['w2'\] only"):
        load_pretrained(folder)
    write_safetensors(folder / "adapter_model.safetensors", {f"base_model.model.{expert}.{proj}.lora_{n}.weight": m
                                                             for proj, pair in adapters.items() for n, m in zip("AB", pair)})
    merged = tmp_path / "merged"
    shutil.copytree(base, merged)
    shard = HFCheckpoint(base).weight_map[f"{expert}.down_proj.weight"]
    tensors = {k: np.array(v) for k, v in _read(base / shard).items()}
    for proj, (a, b) in adapters.items():
        tensors[f"{expert}.{proj}.weight"] += alpha / r * b @ a
    write_safetensors(merged / shard, tensors, metadata={"format": "pt"})
    model = load_pretrained(folder)
    assert model.moe_layers.ffn.w2_lora.a.shape[:2] == (2, CFG.num_routed_experts)
    _close(np.asarray(model(TOKENS)), np.asarray(load_pretrained(merged)(TOKENS)))

"""A converted test checkpoint for the serving tests: tiny HF folder -> `python -m dsv3_jax.convert`
-> Orbax, with the bundled tokenizer.json and a DeepSeek-style chat template beside it."""

from __future__ import annotations

import json
import pathlib
import shutil

from dsv3_jax.config import ModelConfig
from dsv3_jax.data.tokenizer import BUNDLED_PATH
from benchmarks.make_synthetic_checkpoint import make_checkpoint

# DeepSeek-V3's turn layout, written for the bundled tokenizer's special tokens.
CHAT_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] %}{% endif %}"
    "{% endfor %}{{ bos_token }}{{ ns.system }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<User>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<Assistant>' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<Assistant>' }}{% endif %}")


def serve_config(**overrides) -> ModelConfig:
    """Dense + MoE layers at test size, the bundled tokenizer's vocabulary, fp32."""
    base = dict(vocab_size=2048, num_layers=3, num_dense_layers=1, num_routed_experts=8, num_expert_groups=4,
                num_groups_per_token=2, num_experts_per_token=2, num_mtp_layers=1, param_dtype="float32",
                compute_dtype="float32", max_position_embeddings=1024)
    return ModelConfig.tiny(**{**base, **overrides})


def make_served_checkpoint(root: pathlib.Path) -> pathlib.Path:
    from dsv3_jax.convert import main as convert

    hf, out = root / "hf", root / "tiny-serve"
    make_checkpoint(serve_config(), str(hf), dtype="float32", seed=3)
    if convert(["--no-progress", "--hf-dir", str(hf), "--out", str(out)]) != 0:
        raise RuntimeError("conversion of the serving test checkpoint failed")
    shutil.copy(BUNDLED_PATH, out / "tokenizer.json")
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out

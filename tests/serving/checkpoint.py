"""A converted test checkpoint for the serving tests: tiny HF folder -> `python -m dsv3_jax.convert`
-> Orbax, with the bundled tokenizer.json and a DeepSeek-style chat template (tool calls included) beside it."""

from __future__ import annotations

import json
import pathlib
import shutil

from dsv3_jax.config import ModelConfig
from dsv3_jax.data.tokenizer import BUNDLED_PATH
from benchmarks.make_synthetic_checkpoint import make_checkpoint

# DeepSeek-V3's turn layout and tool-call format, written for the bundled tokenizer's special tokens;
# the tools are named after the system prompt (DeepSeek-V3's own template leaves them to the system prompt).
CHAT_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] %}{% endif %}"
    "{% endfor %}{{ bos_token }}{{ ns.system }}"
    "{% for t in tools or [] %}{{ '<Tool>' + t['function']['name'] }}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<User>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<Assistant>' + (m['content'] or '') }}"
    "{% if m['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}{% for c in m['tool_calls'] %}"
    "{{ ('' if loop.first else '\\n') + '<｜tool▁call▁begin｜>' + c['type'] + '<｜tool▁sep｜>' + c['function']['name'] }}"
    "{{ '\\n```json\\n' + c['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}"
    "{% endfor %}{{ '<｜tool▁calls▁end｜>' }}{% endif %}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<｜tool▁outputs▁begin｜>' if loop.first or loop.previtem['role'] != 'tool' else '\\n' }}"
    "{{ '<｜tool▁output▁begin｜>' + m['content'] + '<｜tool▁output▁end｜>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}{% endif %}"
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

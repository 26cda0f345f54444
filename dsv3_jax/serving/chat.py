"""Tokenizer and chat template for the server.

Tokenizer: the checkpoint folder's `tokenizer.json` when it has one, else `--tokenizer`, else the
bundled BPE (`dsv3_jax/data/assets/tokenizer.json`).

Chat template: the tokenizer's, rendered as HF transformers renders it; the renderer is the one
training renders chat data with (`dsv3_jax/data/chat_template.py`, which documents the rules and
the bundled tokenizer's `BUNDLED_TEMPLATE`). A generation stops at the tokenizer's EOS, which ends
every assistant turn.
"""

from __future__ import annotations

import pathlib

from dsv3_jax.data.chat_template import BUNDLED_TEMPLATE, ChatTemplateError, ChatTokenizer  # noqa: F401 (re-exported)
from dsv3_jax.data.tokenizer import BUNDLED_PATH


def tokenizer_file(checkpoint: str | None, tokenizer: str | None) -> pathlib.Path:
    """The tokenizer.json to serve with, by the rule of the module docstring."""
    if checkpoint is not None and (pathlib.Path(checkpoint) / "tokenizer.json").is_file():
        return pathlib.Path(checkpoint) / "tokenizer.json"
    if tokenizer is not None:
        path = pathlib.Path(tokenizer)
        return path / "tokenizer.json" if path.is_dir() else path
    return BUNDLED_PATH

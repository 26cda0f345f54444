"""Chat data for fine-tuning: conversations -> token ids and the loss mask of the assistant tokens.

File: `.jsonl`, one JSON object per line with `messages`, a list of {"role": str, "content": str}
(system, developer, user, assistant, or any role the template knows), as many turns as wanted.
The bundled set (`assets/chat.jsonl`, made by `python -m dsv3_jax.data.make_chat`) is the default.

Encoding (`encode_conversation`): the tokenizer's chat template renders the whole conversation as HF
renders it (`chat_template.py`), the text is encoded at once (so the BPE merges at turn seams are
the ones inference sees), and a token is an assistant token (mask 1) when its characters overlap a
`{% generation %}` block of the template: the rule of HF's `return_assistant_tokens_mask`. So the
mask comes per message from the template's own marks, never from diffing prompt prefixes. A
template without such marks is an error naming it (`ChatTemplateError`), never an all-ones mask; a
conversation in which it marks nothing is a `DataError` naming its file and line.

Packing: a conversation is one segment of the packed rows (`pipeline.py`): never split, packed whole
beside others, attention kept inside it by the segment ids. One longer than a row cannot be packed
whole; it is left out with a warning naming its file and line.
"""

from __future__ import annotations

import logging
import pathlib

import numpy as np

from dsv3_jax.data.chat_template import ChatTemplateError, ChatTokenizer
from dsv3_jax.data.sources import DataError, expand_paths, json_lines
from dsv3_jax.data.tokenizer import BUNDLED_PATH

BUNDLED_CHAT_PATH = pathlib.Path(__file__).parent / "assets" / "chat.jsonl"
MESSAGES_FIELD = "messages"


def read_chat_file(path: str) -> list[tuple[list[dict], str]]:
    """(messages, "file:line") of each conversation of a `.jsonl` chat file; a malformed line fails naming
    file:line."""
    conversations = []
    for where, obj in json_lines(path):
        messages = obj.get(MESSAGES_FIELD) if isinstance(obj, dict) else None
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: expected an object with a non-empty list {MESSAGES_FIELD!r}.")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: {MESSAGES_FIELD}[{i}] must be an object with string 'role' and 'content'.")
        conversations.append((messages, where))
    return conversations


def open_chat_source(data=None) -> list[tuple[list[dict], str]]:
    """The conversations of `data` (globs of `.jsonl` files, as `sources.open_source`), each
    (messages, "file:line"); None: the bundled set."""
    paths = [str(BUNDLED_CHAT_PATH)] if data is None else expand_paths(data)
    conversations = []
    for path in paths:
        if not path.endswith(".jsonl"):
            raise DataError(f"{path}: chat data must be .jsonl files of {{\"{MESSAGES_FIELD}\": [...]}} lines.")
        conversations += read_chat_file(path)
    return conversations


def chat_tokenizer(tokenizer_path=None, template_file=None) -> ChatTokenizer:
    """The tokenizer and template chat data is rendered with; fails naming the template when it
    cannot mark assistant turns."""
    chat = ChatTokenizer(tokenizer_path or BUNDLED_PATH, template_file=template_file)
    chat.check_marks_assistant()
    return chat


def encode_conversation(chat: ChatTokenizer, messages: list[dict], where: str = "conversation"
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Returns int32 ids [n] of the rendered conversation and its int32 loss mask [n] (1: assistant)."""
    try:
        text, spans = chat.render_with_spans(messages)
    except ChatTemplateError as e:
        raise DataError(f"{where}: {e}") from e
    if not spans:
        raise DataError(f"{where}: the chat template ({chat.template_origin}) marks no assistant text in this "
                        "conversation (does it have an assistant turn?)")
    encoding = chat.tokenizer.hf.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, np.int32)
    offsets_Nx2 = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), bool)
    for start, end in spans:  # the token's characters [a, b) overlap the block's [start, end)
        mask |= (offsets_Nx2[:, 0] < end) & (start < offsets_Nx2[:, 1])
    return ids, mask.astype(np.int32)


def encode_fitting(chat: ChatTokenizer, seq_len: int, item: tuple[list[dict], str]) -> list[dict[str, np.ndarray]]:
    """(messages, origin) -> [{"tokens", "loss_mask"}], or [] for one longer than a row."""
    messages, where = item
    ids, mask = encode_conversation(chat, messages, where)
    if len(ids) > seq_len:
        logging.warning("%s: conversation of %d tokens left out: it does not fit a row of %d (data.seq_len "
                        "+ 1); a conversation is never split", where, len(ids), seq_len)
        return []
    return [{"tokens": ids, "loss_mask": mask}]

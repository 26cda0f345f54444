"""Chat data: the loss mask against HF transformers' own assistant mask, the template check,
packing that never splits a conversation, the bundled set, and errors that name the line."""

import json

import numpy as np
import pytest

from dsv3_jax.data import chat, pipeline
from dsv3_jax.data.chat_template import ChatTemplateError, ChatTokenizer
from dsv3_jax.data.make_chat import make_conversations
from dsv3_jax.data.sources import DataError
from dsv3_jax.data.tokenizer import BUNDLED_PATH

# A template in another style: tags, loop controls, trimmed blocks, generation blocks around the
# content only (the end tag outside), system folded into the first turn.
TAGGED_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] in ['system', 'developer'] %}<<SYS>>{{ m['content'] | trim }}<</SYS>>
    {% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]
    {% else %}{% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}
    {% endif %}
{% endfor %}"""

EXTRA = [
    [{"role": "developer", "content": "Numbers only."}, {"role": "user", "content": "12+30?"},
     {"role": "assistant", "content": "42"}, {"role": "user", "content": "ünïcode: double it"},
     {"role": "assistant", "content": "84\n\n  (twice 42)"}],
    [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello there, friend!"}],
]


def hf_tokenizer(template):
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_PATH), bos_token="<|bos|>",
                                               eos_token="<|eos|>", pad_token="<|pad|>")
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [None, TAGGED_TEMPLATE], ids=["bundled", "tagged"])
def test_mask_equals_hf_assistant_tokens_mask(tmp_path, template):
    """ids and mask per conversation equal apply_chat_template(return_assistant_tokens_mask=True)."""
    template_file = None
    if template is not None:
        template_file = tmp_path / "t.jinja"
        template_file.write_text(template)
    ours = chat.chat_tokenizer(None, template_file)
    hf = hf_tokenizer(ours.template)
    source = chat.open_chat_source()
    conversations = [source[i][0] for i in range(0, len(source), 12)] + EXTRA
    for messages in conversations:
        ids, mask = chat.encode_conversation(ours, messages)
        want = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == want["input_ids"], messages
        assert mask.tolist() == want["assistant_masks"], messages
        turns = sum(m["role"] == "assistant" for m in messages)
        assert np.sum(np.diff(np.concatenate([[0], mask])) == 1) == turns  # one run of ones per assistant turn


def test_template_without_assistant_marks_is_an_error_naming_it(tmp_path):
    plain = tmp_path / "plain.jinja"
    plain.write_text(TAGGED_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    with pytest.raises(ChatTemplateError, match=f"{plain}.*marks no assistant text"):
        chat.chat_tokenizer(None, plain)
    with pytest.raises(ChatTemplateError, match="marks no assistant text"):
        pipeline.make_dataset(pipeline.DataConfig(seq_len=129, batch_size=2, format="chat", chat_template=str(plain)),
                              process_index=0, process_count=1)


def test_conversations_are_packed_whole_and_never_split(tmp_path):
    """Every segment of every eval row is one whole conversation, with its own mask; those longer
    than a row are left out; every other held-out conversation appears exactly once."""
    long = [{"role": "user", "content": "Tell me a long story."}, {"role": "assistant", "content": "Once " * 150}]
    conversations = make_conversations(41, seed=3)
    held_out = pipeline.split_indices(len(conversations), 0.5)["eval"]
    conversations[held_out[0]] = {"messages": long}  # held out, and longer than a row
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in conversations) + "\n")
    config = pipeline.DataConfig(seq_len=129, batch_size=3, data=str(path), format="chat", eval_fraction=0.5)
    source, tok = chat.open_chat_source(str(path)), chat.chat_tokenizer()
    want = [chat.encode_conversation(tok, source[int(i)][0]) for i in held_out]
    want = [(tuple(ids), tuple(mask)) for ids, mask in want if len(ids) <= 129]
    assert len(want) == len(held_out) - 1  # the long one is left out
    seen = []
    for batch in pipeline.make_dataset(config, "eval", process_index=0, process_count=1):
        for row in range(3):
            seg = batch["segment_ids"][row]
            for s in range(1, seg.max() + 1):
                at = seg == s
                assert np.all(np.diff(np.flatnonzero(at)) == 1)  # contiguous
                np.testing.assert_array_equal(batch["positions"][row][at], np.arange(at.sum()))
                seen.append((tuple(batch["tokens"][row][at]), tuple(batch["loss_mask"][row][at])))
            assert not batch["loss_mask"][row][seg == 0].any()
    assert sorted(seen) == sorted(want)


def test_bundled_set_is_what_make_chat_writes():
    lines = [json.dumps(c, ensure_ascii=False) for c in make_conversations(480, 0)]
    assert chat.BUNDLED_CHAT_PATH.read_text(encoding="utf-8") == "\n".join(lines) + "\n"


@pytest.mark.parametrize("line, match", [
    ("not json", "unreadable JSON"),
    ('{"text": "hi"}', "non-empty list 'messages'"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\] must be an object"),
])
def test_malformed_lines_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}]}\n\n' + line + "\n")
    with pytest.raises(DataError, match=f"{path}:3: .*{match}"):
        chat.open_chat_source(str(path))


def test_conversation_without_assistant_text_names_its_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
    source = chat.open_chat_source(str(path))
    with pytest.raises(DataError, match=f"{path}:1: .*marks no assistant text"):
        chat.encode_conversation(ChatTokenizer(BUNDLED_PATH), *source[0])

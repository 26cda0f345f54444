"""Chat templates against HF transformers' own rendering; streaming text and stop strings."""

import json

import pytest

from dsv3_jax.data import load_tokenizer
from dsv3_jax.data.tokenizer import BUNDLED_PATH
from dsv3_jax.serving.chat import BUNDLED_TEMPLATE, ChatTemplateError, ChatTokenizer
from dsv3_jax.serving.textstream import TextStream
from tests.serving.checkpoint import CHAT_TEMPLATE

# Loops, namespace, tojson, loop controls, trimmed blocks: the features HF templates rely on.
RICH_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if loop.index0 > 6 %}{% break %}{% endif %}
    {% if m['role'] == 'tool' %}<Tool>{{ m['content'] | tojson }}
    {% else %}<{{ m['role'] | capitalize }}>{{ m['content'] | trim }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<Assistant>{% endif %}"""

MESSAGES = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "  Who are you?"},
     {"role": "assistant", "content": "A fox."}, {"role": "tool", "content": "ünïcode \"quoted\""},
     {"role": "user", "content": "And then?"}],
    [{"role": "user", "content": "Weather in Oslo and Rome?"},  # two calls, their two results
     {"role": "assistant", "tool_calls": [  # no content (transformers 5 drops a None content; the server keeps it)
         {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "tool", "content": "rain"},
     {"role": "assistant", "content": "Sunny, then rain."}, {"role": "user", "content": "Thanks"}],
]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_PATH), bos_token="<|bos|>",
                                                eos_token="<|eos|>", pad_token="<|pad|>")


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE, BUNDLED_TEMPLATE])
@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_renders_and_encodes_as_hf(tmp_path, hf_tokenizer, template, messages, add_generation_prompt):
    (tmp_path / "tokenizer.json").write_bytes(BUNDLED_PATH.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": %s}' % __import__("json").dumps(template))
    ours = ChatTokenizer(tmp_path / "tokenizer.json")
    tools = TOOLS if any("tool_calls" in m for m in messages) else None
    kw = dict(chat_template=template, add_generation_prompt=add_generation_prompt, tools=tools)
    assert ours.render(messages, add_generation_prompt=add_generation_prompt, tools=tools) == \
        hf_tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools) == \
        list(hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def test_bundled_template_writes_arguments_given_as_an_object_as_their_json():
    """HF templates take a call's arguments as an object too; the bundled one writes it with tojson."""
    chat, call = ChatTokenizer(BUNDLED_PATH), MESSAGES[2][1]["tool_calls"][1]
    as_object = [MESSAGES[2][0], MESSAGES[2][1] | {"tool_calls": [
        call | {"function": {"name": "get_weather", "arguments": json.loads(call["function"]["arguments"])}}]}]
    as_text = [MESSAGES[2][0], MESSAGES[2][1] | {"tool_calls": [call]}]
    assert chat.render(as_object) == chat.render(as_text)
    assert '```json\n{"city": "Rome"}\n```' in chat.render(as_text)


def test_bundled_tokenizer_uses_the_documented_template():
    chat = ChatTokenizer(BUNDLED_PATH)
    text = chat.render([{"role": "user", "content": "hi"}])
    assert text == "<|bos|>User: hi\n\nAssistant:"


def test_a_copy_of_the_bundled_tokenizer_uses_its_template(tmp_path):
    """A training run exported with --to-hf carries a copy of the bundled tokenizer.json."""
    (tmp_path / "tokenizer.json").write_bytes(BUNDLED_PATH.read_bytes())
    text = ChatTokenizer(tmp_path / "tokenizer.json").render([{"role": "user", "content": "hi"}])
    assert text == "<|bos|>User: hi\n\nAssistant:"


def test_no_template_is_a_clear_error(tmp_path):
    # Another tokenizer (same vocabulary, written differently) with no tokenizer_config.json.
    other = json.loads(BUNDLED_PATH.read_text(encoding="utf-8"))
    (tmp_path / "tokenizer.json").write_text(json.dumps(other, indent=1), encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTokenizer(tmp_path / "tokenizer.json").render([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _stream(tok, text: str, stop: list[str], include_stop: bool = False) -> tuple[list[str], bool]:
    """Feeds `text`'s ids one at a time; returns the deltas (finish() appended) and whether it stopped."""
    s = TextStream(tok, stop, include_stop)
    deltas = []
    for i in tok.encode(text):
        deltas.append(s.push([i]))
        if s.stopped:
            break
    deltas.append(s.finish())
    return deltas, s.stopped


def test_stream_deltas_concatenate_to_the_text(tok):
    text = "The quick brown fox — ünïcode — jumps."
    deltas, stopped = _stream(tok, text, [])
    assert "".join(deltas) == text and not stopped
    assert all("\ufffd" not in d for d in deltas), "incomplete UTF-8 must be held back"


@pytest.mark.parametrize("stop, expected", [
    (["fox"], "The quick brown "),
    (["jumps", "quick"], "The "),
    (["nothing here"], "The quick brown fox jumps."),
    (["s."], "The quick brown fox jump"),
])
def test_stop_strings_cut_and_are_never_emitted(tok, stop, expected):
    deltas, stopped = _stream(tok, "The quick brown fox jumps.", stop)
    assert "".join(deltas) == expected
    assert stopped == (expected != "The quick brown fox jumps.")
    shown = ""
    for d in deltas:  # no prefix of what was shown contains a stop string
        shown += d
        assert not any(s in shown for s in stop)


@pytest.mark.parametrize("stop, expected", [
    (["fox"], "The quick brown fox"),
    (["jumps", "quick"], "The quick"),
    (["s."], "The quick brown fox jumps."),
])
def test_include_stop_ends_the_text_after_the_stop_string(tok, stop, expected):
    deltas, stopped = _stream(tok, "The quick brown fox jumps. And more.", stop, include_stop=True)
    assert "".join(deltas) == expected and stopped

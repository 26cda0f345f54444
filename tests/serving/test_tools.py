"""Tool calls in DeepSeek-V3's format, in process: the grammar that forces them (walked under llguidance's
own token masks, every walk parsed back and its arguments validated with jsonschema), the template's
lead-in, and the parser, whole and streamed token by token."""

import json
import pathlib

import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import pytest

from dsv3_jax.data import load_tokenizer
from dsv3_jax.data.tokenizer import BUNDLED_PATH
from dsv3_jax.serving import tools
from dsv3_jax.serving.chat import ChatTokenizer
from dsv3_jax.serving.textstream import TextStream
from tests.serving.checkpoint import CHAT_TEMPLATE

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "metric": {"type": "boolean"},
                                            "note": {"type": "string", "maxLength": 6}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
FUNCTIONS = {"get_weather": WEATHER, "get_time": TIME}
MARKERS = (tools.CALLS_BEGIN, tools.CALL_BEGIN, tools.SEP, tools.CALL_END, tools.CALLS_END)


def _folder(tmp_path, template: str | None, specials: tuple[str, ...] = ()):
    """A tokenizer folder: the bundled BPE, `specials` added as special tokens, `template` as its chat template."""
    tok = json.loads(BUNDLED_PATH.read_text(encoding="utf-8"))
    vocab = len(tok["model"]["vocab"])
    tok["added_tokens"] += [{"id": vocab + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, s in enumerate(specials)]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"} | ({"chat_template": template} if template else {})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return ChatTokenizer(tmp_path / "tokenizer.json")


# DeepSeek-V3's way: a turn of calls alone is the one whose content is none.
V3_STYLE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
            "{% elif m['role'] == 'assistant' and m['content'] is none %}{{ '<｜Assistant｜><｜tool▁calls▁begin｜>' }}"
            "{% for c in m['tool_calls'] %}{{ '<｜tool▁call▁begin｜>' + c['type'] + '<｜tool▁sep｜>' + c['function']['name'] }}"
            "{% endfor %}{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")


def test_lead_in_is_what_each_template_writes_before_the_calls(tmp_path):
    assert tools.lead_in(ChatTokenizer(BUNDLED_PATH)) == " "  # "Assistant:" then " " + content
    assert tools.lead_in(_folder(tmp_path, CHAT_TEMPLATE)) == ""  # "<Assistant>" then the calls
    assert tools.lead_in(_folder(tmp_path, V3_STYLE)) == ""  # the turn of calls is told by its content None
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not write tool calls in DeepSeek-V3's format"):
        tools.lead_in(_folder(tmp_path, plain))


def _walk(chat, grammar: str, rng, max_tokens: int = 400) -> list[int]:
    """A random walk of tokens, each drawn uniformly from the ones llguidance's matcher allows."""
    tok = chat.tokenizer
    ll = llguidance.LLTokenizer(pathlib.Path(tok.path).read_text(encoding="utf-8"), n_vocab=tok.vocab_size,
                                eos_token=tok.eos_id)
    matcher = llguidance.LLMatcher(ll, grammar)
    assert not matcher.is_error(), matcher.get_error()
    mask = llguidance.numpy.allocate_token_bitmask(1, ll.vocab_size)
    out = []
    while not matcher.is_stopped() and len(out) < max_tokens:
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:ll.vocab_size])
        out.append(int(rng.choice(allowed)))
        assert matcher.consume_token(out[-1]), matcher.get_error()
    assert matcher.is_stopped(), "the walk did not end"
    return out


@pytest.mark.parametrize("specials", [False, True], ids=["markers-as-text", "markers-as-special-tokens"])
@pytest.mark.parametrize("functions, parallel", [(FUNCTIONS, True), ({"get_time": TIME}, False)])
def test_forced_calls_parse_and_validate(tmp_path, specials, functions, parallel):
    """Whatever the grammar lets through reads back as calls of the allowed functions whose arguments
    validate; one call only when not parallel. Markers that are special tokens are generated as those tokens."""
    chat = _folder(tmp_path, CHAT_TEMPLATE, MARKERS if specials else ())
    grammar = tools.grammar(functions, tools.lead_in(chat), parallel, chat.tokenizer)
    rng, counts = np.random.default_rng(0), []
    for _ in range(8):
        ids = _walk(chat, grammar, rng)
        if specials:
            assert chat.tokenizer.hf.token_to_id(tools.CALLS_BEGIN) == ids[0]
        text = chat.tokenizer.decode(ids, skip_special_tokens=False)
        reader = tools.ToolCallStream()
        content, deltas = reader.push(text, final=True)
        calls = tools.merged(deltas)
        assert content == "" and calls
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), functions[call["function"]["name"]])
        counts.append(len(calls))
    assert max(counts) == 1 if not parallel else max(counts) > 1


def test_a_schema_the_grammar_library_refuses_names_its_function():
    with pytest.raises(ValueError, match="function 'bad'"):
        tools.grammar({"bad": {"type": "no-such-type"}}, " ", True, load_tokenizer())


def _call(name: str, args: str) -> str:
    return f"{tools.CALL_BEGIN}function{tools.SEP}{name}{tools.ARGS_BEGIN}{args}{tools.ARGS_END}"


OSLO, LIST = '{"city": "Oslo"}', '{"a": [1, 2]}'
TWO_CALLS = " " + tools.CALLS_BEGIN + _call("get_weather", OSLO) + "\n" + _call("get_time", "{}") + tools.CALLS_END
UNREADABLE = " cut " + tools.CALLS_BEGIN + tools.CALL_BEGIN + "func"


@pytest.mark.parametrize("text, content, calls", [
    (TWO_CALLS, "", [("get_weather", OSLO), ("get_time", "{}")]),
    (" Let me look. " + tools.CALLS_BEGIN + _call("f", LIST) + tools.CALLS_END, " Let me look.", [("f", LIST)]),
    (" Just an answer, ünïcode and all. ", " Just an answer, ünïcode and all. ", []),
    (UNREADABLE, UNREADABLE, []),
])
def test_streamed_and_whole_reading_agree(text, content, calls):
    """The deltas of a token-by-token stream (through the engine's TextStream) add up to the whole reading,
    which is the text's own calls; a call that never became readable stays content."""
    tok = load_tokenizer()
    whole = tools.ToolCallStream()
    got_content, deltas = whole.push(text, final=True)
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in tools.merged(deltas)]
    assert (got_content, got) == (content, calls)
    stream, reader, streamed, streamed_deltas = TextStream(tok, []), tools.ToolCallStream(), "", []
    for i in tok.encode(text):
        c, d = reader.push(stream.push([i]))
        streamed, streamed_deltas = streamed + c, streamed_deltas + d
    c, d = reader.push(stream.finish(), final=True)
    streamed, streamed_deltas = streamed + c, streamed_deltas + d
    assert streamed == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tools.merged(streamed_deltas)] == calls
    assert all(set(d) == {"index", "function"} for d in streamed_deltas if "id" not in d)  # OpenAI's delta shape

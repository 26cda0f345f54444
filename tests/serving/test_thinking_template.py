"""DeepSeek-V3.1's hybrid thinking chat template, rendered as HF transformers renders it, with its
`thinking` switch passed as HF's apply_chat_template(thinking=...) and the server's
`chat_template_kwargs` pass it.

The fixture holds the `chat_template` of DeepSeek-V3.1's tokenizer_config.json (thinking off
unless `thinking` is set: the generation prompt ends in `</think>`, or `<think>` with thinking on;
earlier assistant turns keep only the text after their `</think>`).
"""

import pathlib
import types

import pytest

from dsv3_jax.data.tokenizer import BUNDLED_PATH
from dsv3_jax.serving.chat import ChatTemplateError, ChatTokenizer
from tests.helpers import app_in_thread, http_json

TEMPLATE = pathlib.Path(__file__).parent.parent / "fixtures" / "deepseek_v3_1_chat_template.jinja"

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in English."},
     {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>greet back</think>Hello!"},
     {"role": "user", "content": "And 3 * 3?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
     {"role": "tool", "content": "18C"}, {"role": "assistant", "content": "It is 18C."},
     {"role": "user", "content": "Thanks"}],
]


@pytest.fixture(scope="module")
def chat():
    return ChatTokenizer(BUNDLED_PATH, template_file=TEMPLATE)


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_PATH), bos_token="<|bos|>",
                                                eos_token="<|eos|>", pad_token="<|pad|>")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("thinking", [None, False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_hf(chat, hf_tokenizer, messages, thinking, add_generation_prompt):
    extra = {} if thinking is None else {"thinking": thinking}
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, chat_template=TEMPLATE.read_text("utf-8"),
                                            add_generation_prompt=add_generation_prompt, **extra)
    assert chat.render(messages, add_generation_prompt=add_generation_prompt, **extra) == want
    if add_generation_prompt:
        assert want.endswith("<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>")


def test_the_renderers_own_variables_cannot_be_passed(chat):
    with pytest.raises(ChatTemplateError, match="bos_token"):
        chat.render(CONVERSATIONS[0], bos_token="<s>")


def serving(chat):
    """`make_app` on 127.0.0.1 (uvicorn in a thread) with `chat`; /tokenize needs no model, so the
    engine is a stand-in with the sizes the app reads."""
    from dsv3_jax.serving import make_app

    runner = types.SimpleNamespace(context=4096, drafts=0,
                                   config=types.SimpleNamespace(vocab_size=chat.tokenizer.vocab_size))
    engine = types.SimpleNamespace(runner=runner, eos_ids=(), grammars=None,
                                   metrics=types.SimpleNamespace(response=lambda status: None))
    return app_in_thread(make_app(engine, chat, "m"))


def test_server_passes_chat_template_kwargs(chat):
    messages = CONVERSATIONS[1]
    with serving(chat) as url:
        for kwargs in (None, {"thinking": True}):
            status, out = http_json(url + "/tokenize", {"messages": messages, "chat_template_kwargs": kwargs})
            assert status == 200
            assert out["tokens"] == chat.encode_chat(messages, **(kwargs or {}))
        status, out = http_json(url + "/tokenize", {"messages": messages, "chat_template_kwargs": {"messages": []}})
        assert status == 400 and out["error"]["param"] == "chat_template_kwargs"

"""Tool calls through the official openai client against `python -m experiments.serve` (the shared test
server, whose folder template writes DeepSeek-V3's tool-call format): `tool_choice` "required" and a named
function return calls whose arguments validate (jsonschema), streamed and not, and the conversation goes on
with the tool's result; "none" answers in text. Prompts are counted against transformers' own rendering."""

import json

import jsonschema
import openai
import pytest

from tests.serving.test_api_surface import call

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "metric": {"type": "boolean"}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def hf_chat(served_checkpoint):
    """Prompt length as transformers renders the served folder's template: the reference for prompt_tokens."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(served_checkpoint))
    return lambda messages, tools: len(hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                              tokenize=True, return_dict=False))


def _streamed(chunks) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) put together from chat chunks, as a client does."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def _validate(calls: list[tuple[str, str]], allowed: dict) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), allowed[name])


def test_required_calls_validate_and_the_result_is_answered(client, model, hf_chat):
    args = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=400)
    out = client.chat.completions.create(**args)
    message, finish = out.choices[0].message, out.choices[0].finish_reason
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert finish == "tool_calls" and message.content is None
    assert all(c.type == "function" and c.id.startswith("call_") for c in message.tool_calls)
    _validate(calls, SCHEMAS)
    assert out.usage.prompt_tokens == hf_chat(ASK, TOOLS)
    assert _streamed(client.chat.completions.create(stream=True, **args)) == ("", calls, "tool_calls")

    results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 21})} for c in message.tool_calls]
    follow = ASK + [message] + results  # the client sends the answer's message object back as it came
    args = dict(model=model, messages=follow, tools=TOOLS, temperature=0, max_tokens=6)
    answer = client.chat.completions.create(**args)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens == hf_chat(ASK + [message.model_dump(exclude_none=True)] + results, TOOLS)
    text = answer.choices[0].message.content
    assert _streamed(client.chat.completions.create(stream=True, **args)) == (text, [], answer.choices[0].finish_reason)


def test_required_calls_are_strict_and_end_within_max_tokens(client, model):
    """A parameters schema without additionalProperties and with a free string, sampled: the arguments hold
    the named properties only and the calls end (a budget-forced completion) before max_tokens. With the
    template's markers as text the shortest answer is some 120 tokens."""
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "find", "parameters": place}}]
    for seed in range(2):
        out = client.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice="required",
                                             temperature=1, seed=seed, max_tokens=160)
        assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
        _validate([(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls],
                  {"find": {**place, "additionalProperties": False}})


def test_a_named_function_is_the_one_called(client, model):
    args = dict(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200, parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": "get_time"}})
    out = client.chat.completions.create(**args).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert out.finish_reason == "tool_calls" and [name for name, _ in calls] == ["get_time"]
    _validate(calls, {"get_time": TIME})
    assert _streamed(client.chat.completions.create(stream=True, **args)) == ("", calls, "tool_calls")


def test_none_answers_in_text_with_the_tools_in_the_prompt(client, model, server, hf_chat):
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                         max_tokens=6)
    assert out.choices[0].message.tool_calls is None and isinstance(out.choices[0].message.content, str)
    assert out.usage.prompt_tokens == hf_chat(ASK, TOOLS) != hf_chat(ASK, None)
    assert call(server[0], "POST", "/tokenize", {"messages": ASK, "tools": TOOLS})[1]["count"] == hf_chat(ASK, TOOLS)


@pytest.mark.parametrize("extra, match", [
    (dict(tool_choice="required"), "no tools are given"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_mail"}}), "'get_mail' is not among"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          tool_choice="required"), "function 'f'"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "structured output"),
])
def test_tool_choice_that_cannot_be_met_is_a_400(client, model, extra, match):
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **extra)
    assert e.value.body["param"] == "tool_choice"

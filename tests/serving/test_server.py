"""The OpenAI client against `python -m experiments.serve`: completions, chat, streaming, stop
strings, max_tokens, usage, errors, 429, and a 20 s soak (the 60 s run is `python -m tests.serving.soak`)."""

import concurrent.futures
import http.client
import json
import urllib.parse

import openai
import pytest

from dsv3_jax.serving import ChatTokenizer, tokenizer_file
from tests.serving import soak
from tests.serving.conftest import MAX_QUEUE, MAX_SEQ_LEN

PROMPT = "Once upon a time there was a fox"


@pytest.fixture(scope="module")
def chat_tokenizer(served_checkpoint):
    return ChatTokenizer(tokenizer_file(str(served_checkpoint), None))


def test_models_lists_the_checkpoint(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_completion_max_tokens_and_usage(client, model, chat_tokenizer):
    tok = chat_tokenizer.tokenizer
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 1 + len(tok.encode(PROMPT))  # BOS + the text
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.choices[0].text


def test_streaming_equals_the_whole_answer(client, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_stop_string_cuts_the_text(client, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = whole[:whole.index(stop)]
    out = client.completions.create(stop=[stop], **args)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(stop=stop, stream=True, **args)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_chat_plain_and_streaming(client, model, chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about foxes"}]
    args = dict(model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**args)
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    expected_prompt = chat_tokenizer.tokenizer.encode(
        "<|bos|>Be brief.<User>Tell me about foxes<Assistant>")  # the checkpoint's template, by hand
    assert out.usage.prompt_tokens == len(expected_prompt) and out.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content


def test_sampling_is_reproducible_per_seed(client, model):
    args = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, extra_body={"ignore_eos": True})
    a, b = (client.completions.create(seed=7, **args).choices[0].text for _ in range(2))
    assert a == b


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model="gpt-4"), openai.NotFoundError, "does not exist"),
    (dict(temperature=3.0), openai.BadRequestError, "temperature"),
    (dict(top_p=0.0), openai.BadRequestError, "top_p"),
    (dict(max_tokens=MAX_SEQ_LEN), openai.BadRequestError, "context length"),
    (dict(prompt="fox " * MAX_SEQ_LEN), openai.BadRequestError, "prompt has"),
    (dict(suffix="x"), openai.BadRequestError, "unsupported option\\(s\\): suffix"),
    (dict(extra_body={"top_k": 2**40}), openai.BadRequestError, "top_k"),
    (dict(extra_body={"stop_token_ids": [10**6]}), openai.BadRequestError, "stop_token_ids"),
])
def test_bad_requests_name_the_problem(client, model, kwargs, error, match):
    with pytest.raises(error, match=match):
        client.completions.create(**(dict(model=model, prompt=PROMPT, max_tokens=4) | kwargs))


def _post(url, body: bytes) -> tuple[int, dict]:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_malformed_json_is_a_400(server):
    status, body = _post(server[0], b'{"model": "x", "prompt": ')
    assert status == 400 and "malformed JSON" in body["error"]["message"]


def test_full_queue_answers_429_and_keeps_serving(server, model):
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True}).encode()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        statuses = [s for s, _ in pool.map(lambda _: _post(server[0], body), range(32))]
    assert 429 in statuses and set(statuses) <= {200, 429}
    assert statuses.count(200) >= MAX_QUEUE
    assert _post(server[0], body)[0] == 200


def test_soak_20s(server, model):
    report = soak.soak(server[0], model, seconds=20, workers=6)
    assert not soak.failures(report), report
    assert report["codes"].get(200, 0) > 20 and sum(n for c, n in report["codes"].items() if 400 <= c < 500) > 5

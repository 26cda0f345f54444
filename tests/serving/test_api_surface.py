"""The API surface around generation: vLLM's tokenizer endpoints (against HF transformers loading the
served folder), /v1/models/{id}, OpenAI-shaped errors for every status, each bad field named,
several prompts with n, and the chat `developer` role."""

import http.client
import json
import time
import urllib.parse

import openai
import pytest

from tests.serving.conftest import MAX_SEQ_LEN

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def hf_tokenizer(served_checkpoint):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(served_checkpoint))


def call(url: str, method: str, path: str, body=None) -> tuple[int, dict]:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_tokenize_and_detokenize_agree_with_hf(server, hf_tokenizer):
    url = server[0]
    status, plain = call(url, "POST", "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and plain["tokens"] == hf_tokenizer.encode(PROMPT, add_special_tokens=False)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == MAX_SEQ_LEN
    _, with_bos = call(url, "POST", "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert with_bos["tokens"] == [hf_tokenizer.bos_token_id] + plain["tokens"]
    assert with_bos["token_strs"] == hf_tokenizer.convert_ids_to_tokens(with_bos["tokens"])
    _, text = call(url, "POST", "/detokenize", {"tokens": plain["tokens"]})
    assert text == {"prompt": hf_tokenizer.decode(plain["tokens"])}
    messages = [{"role": "user", "content": "Hi"}]
    _, chat = call(url, "POST", "/tokenize", {"messages": messages})
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == hf_tokenizer.encode(rendered, add_special_tokens=False)


def test_tokenizer_info_names_the_special_tokens(server, hf_tokenizer):
    status, info = call(server[0], "GET", "/tokenizer_info")
    assert status == 200
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == (
        hf_tokenizer.bos_token, hf_tokenizer.eos_token, hf_tokenizer.pad_token)
    assert info["chat_template"] == hf_tokenizer.chat_template


def test_tokenizer_info_says_whether_the_tokenizer_adds_bos(server, hf_tokenizer):
    _, info = call(server[0], "GET", "/tokenizer_info")
    assert info["add_bos_token"] == (hf_tokenizer("a fox").input_ids[0] == hf_tokenizer.bos_token_id)


def test_models_carry_the_server_start_time(client, model):
    created = client.models.list().data[0].created
    assert created == client.models.retrieve(model).created and time.time() - 3600 < created <= time.time()


def test_model_by_id(client, model):
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["param"] == "model" and "does not exist" in e.value.body["message"]


@pytest.mark.parametrize("method, path, body, status, param, match", [
    ("GET", "/nowhere", None, 404, None, "Not Found"),
    ("GET", "/v1/completions", None, 405, None, "Method Not Allowed"),
    ("POST", "/tokenize", {"prompt": "a", "messages": []}, 400, "messages", "not both"),
    ("POST", "/tokenize", {}, 400, "prompt", "give a prompt or messages"),
    ("POST", "/detokenize", {"tokens": [10**7]}, 400, "tokens", "vocab_size"),
    ("POST", "/v1/chat/completions", {"max_completion_tokens": "abc"}, 400, "max_completion_tokens", "integer"),
    ("POST", "/v1/chat/completions", {"max_completion_tokens": 0}, 400, "max_completion_tokens", "greater than"),
    ("POST", "/v1/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs", "logprobs=true"),
    ("POST", "/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, 400, "top_logprobs", "less than"),
    ("POST", "/v1/completions", {"max_tokens": -1}, 400, "max_tokens", "greater than"),
    ("POST", "/v1/completions", {"max_tokens": True}, 400, "max_tokens", "valid integer"),
    ("POST", "/v1/completions", {"max_tokens": 5.0}, 400, "max_tokens", "valid integer"),
    ("POST", "/v1/completions", {"temperature": float("nan")}, 400, "temperature", "finite number"),
    ("POST", "/v1/completions", {"logit_bias": {"5": float("inf")}}, 400, "logit_bias.5", "finite number"),
    ("POST", "/v1/completions", {"logit_bias": {"5": 101}}, 400, "logit_bias.5", "less than or equal to 100"),
    ("POST", "/v1/completions", {"logprobs": 21}, 400, "logprobs", "less than"),
    ("POST", "/v1/completions", {"prompt": [[1, None]]}, 400, "prompt", "list of token ids"),
    ("POST", "/v1/completions", {"prompt": []}, 400, "prompt", "at least one prompt"),
    ("POST", "/v1/completions", {"prompt": [[]]}, 400, "prompt", "empty"),
    ("POST", "/v1/completions", {"n": 0}, 400, "n", "greater than"),
    ("POST", "/v1/completions", {"n": 2, "best_of": 1}, 400, "best_of", "must be >= n"),
    ("POST", "/v1/completions", {"seed": "x"}, 400, "seed", "integer"),
    ("POST", "/v1/completions", {"stop_token_ids": ["x"]}, 400, "stop_token_ids.0", "integer"),
    ("POST", "/v1/completions", {"echo": "maybe"}, 400, "echo", "boolean"),
    ("POST", "/v1/completions", {"stream_options": {"include_usage": 3}}, 400, "stream_options.include_usage", "bool"),
    ("POST", "/v1/completions", {"frobnicate": 1}, 400, "frobnicate", "unsupported"),
])
def test_every_error_is_openai_shaped_and_names_the_field(server, model, method, path, body, status, param, match):
    if body is not None and path.startswith("/v1/"):
        base = {"model": model, "max_tokens": 2}
        base |= {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
        body = base | body
    got, out = call(server[0], method, path, body)
    assert got == status
    assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["param"] == param and match in out["error"]["message"]


def test_several_prompts_with_n_index_their_choices(client, model):
    prompts = ["Once upon a time", "A fox"]
    args = dict(model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **args).choices[0].text for p in prompts]
    out = client.completions.create(prompt=prompts, n=2, **args)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert out.usage.completion_tokens == 4 * 6


def test_developer_role_is_read_as_system(client, model):
    args = dict(model=model, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    user = {"role": "user", "content": "Tell me about foxes"}
    dev = client.chat.completions.create(messages=[{"role": "developer", "content": "Be brief."}, user], **args)
    system = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."}, user], **args)
    assert dev.usage.prompt_tokens == system.usage.prompt_tokens
    assert dev.choices[0].message.content == system.choices[0].message.content

"""Sampling parameters through the OpenAI client against `python -m experiments.serve`: penalties,
logit_bias and min_tokens against a numpy reference on the full forward's logits, n and best_of,
chat logprobs, and every parameter streamed equal to not streamed."""

import collections
import http.client
import json
import urllib.parse

import jax
import numpy as np
import pytest

from dsv3_jax.serving.penalties import Penalties, PenaltyTables
from dsv3_jax.inference.sampling import RowSampling, penalized_logits
from tests.serving.reference import log_softmax

TOL = 1e-4
PROMPT = [5, 17, 300, 5, 999, 42, 7, 5, 64, 3]


def numpy_penalties(logits, prompt, output, p: Penalties):
    """vLLM's documented rule, token by token: repetition on prompt + output tokens, then
    frequency and presence on output counts, logit_bias, and the min_tokens ban."""
    x = np.array(logits, np.float64)
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition if x[t] > 0 else x[t] * p.repetition
    for t, c in collections.Counter(output).items():
        x[t] -= p.frequency * c + p.presence
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        x[list(p.banned)] = -np.inf
    return x


def test_penalty_tables_equal_the_numpy_rule():
    """The engine's tables (updated token by token) applied on device equal the numpy rule, per row."""
    rng = np.random.RandomState(0)
    v, rows = 64, [Penalties(0.5, 0.3, 1.4, ((3, 2.0), (9, -1.5)), 4, (2, 7)), Penalties(), Penalties(-1, 0, 0.7)]
    s = RowSampling.greedy(len(rows), width=40)
    tables = PenaltyTables(s)
    prompts = [rng.randint(0, v, 8).tolist() for _ in rows]
    outputs = [[] for _ in rows]
    for i, p in enumerate(rows):
        tables.start(i, prompts[i], p)
    apply = jax.jit(penalized_logits)
    for _ in range(6):
        logits = rng.randn(len(rows), v).astype(np.float32) * 3
        got = np.asarray(apply(logits, s))
        for i, p in enumerate(rows):
            np.testing.assert_allclose(got[i], numpy_penalties(logits[i], prompts[i], outputs[i], p), rtol=1e-6)
            token = [3, 9, 2][i] if len(outputs[i]) % 2 else int(rng.randint(0, v))
            outputs[i].append(token)
            tables.observe(i, [token])


PENALIZED = dict(presence_penalty=0.6, frequency_penalty=0.4,
                 extra_body={"repetition_penalty": 1.5, "logit_bias": {"77": 3.0, "5": -2.0}, "ignore_eos": True,
                             "return_tokens_as_token_ids": True})


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_penalties_equal_the_numpy_reference_on_the_logits(client, model, ref, temperature):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=temperature, seed=5,
                                    logprobs=3, **PENALIZED).choices[0]
    tokens = [int(t.removeprefix("token_id:")) for t in out.logprobs.tokens]
    p = Penalties(0.6, 0.4, 1.5, ((77, 3.0), (5, -2.0)))
    raw = ref.logits([PROMPT + tokens])[0][len(PROMPT) - 1:-1]
    for i, (token, served) in enumerate(zip(tokens, out.logprobs.token_logprobs)):
        want = log_softmax(numpy_penalties(raw[i], PROMPT, tokens[:i], p) / (temperature or 1.0))
        if temperature == 0:
            assert token == int(np.argmax(want)), f"step {i}"
        assert abs(served - want[token]) < TOL, (i, served, want[token])


def test_min_tokens_holds_back_eos(client, model, server):
    eos = 2  # the bundled tokenizer's <|eos|>; logit_bias makes it certain once allowed
    args = dict(model=model, prompt=PROMPT, max_tokens=20, temperature=0, logit_bias={str(eos): 100})
    assert client.completions.create(**args).usage.completion_tokens == 1
    out = client.completions.create(extra_body={"min_tokens": 5}, **args)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 6


def test_n_greedy_identical_and_seeded_reproducible(client, model):
    args = dict(model=model, prompt="Once upon a time", max_tokens=10, n=4, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **args)
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3] and len({c.text for c in greedy.choices}) == 1
    a, b = (client.completions.create(temperature=1.0, seed=11, **args) for _ in range(2))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # the choices draw with different seeds


def test_best_of_returns_the_likeliest_candidate(client, model):
    args = dict(model=model, prompt="The fox", max_tokens=8, temperature=1.0, seed=4, logprobs=0,
                extra_body={"ignore_eos": True})
    candidates = client.completions.create(n=3, **args).choices
    best = client.completions.create(n=1, best_of=3, **args).choices
    totals = [sum(c.logprobs.token_logprobs) for c in candidates]
    assert len(best) == 1 and best[0].index == 0 and best[0].text == candidates[int(np.argmax(totals))].text


def test_chat_logprobs_and_n(client, model, ref, server):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Foxes?"}]
    u = urllib.parse.urlparse(server[0])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", "/tokenize", json.dumps({"messages": messages}), {"Content-Type": "application/json"})
    prompt = json.loads(conn.getresponse().read())["tokens"]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, n=2,
                                         logprobs=True, top_logprobs=4,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1]
    content = out.choices[0].logprobs.content
    tokens = [int(c.token.removeprefix("token_id:")) for c in content]
    want = ref.logprobs([prompt + tokens])[0][len(prompt) - 1:-1]
    assert tokens == [int(np.argmax(w)) for w in want]
    np.testing.assert_allclose([c.logprob for c in content], want.max(-1), atol=TOL, rtol=0)
    for c, w in zip(content, want):
        np.testing.assert_allclose([t.logprob for t in c.top_logprobs], np.sort(w)[::-1][:4], atol=TOL, rtol=0)
    # the same tokens; log-probabilities equal up to rounding (the choices may decode in batches of
    # different sizes, whose matmuls round differently)
    other = out.choices[1].logprobs.content
    assert [c.token for c in other] == [c.token for c in content]
    np.testing.assert_allclose([c.logprob for c in other], [c.logprob for c in content], atol=TOL, rtol=0)


def test_chat_n_and_logprobs_stream_what_they_answer(client, model):
    args = dict(model=model, messages=[{"role": "user", "content": "Foxes?"}], max_tokens=6, temperature=0.8, seed=9,
                n=2, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, **args))
    for c in whole.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == c.finish_reason
        assert "".join(m.delta.content or "" for m in mine) == c.message.content
        streamed = [t for m in mine if m.logprobs for t in m.logprobs.content]
        assert [t.token for t in streamed] == [t.token for t in c.logprobs.content]
        # the same draws; log-probabilities equal up to rounding (the two requests decode beside others,
        # in batches whose matmuls round differently: 1.9e-6 apart under jax 0.12's XLA:CPU)
        np.testing.assert_allclose([t.logprob for t in streamed], [t.logprob for t in c.logprobs.content], atol=1e-5)


@pytest.mark.parametrize("extra", [
    dict(temperature=0.9, top_p=0.8, seed=1), dict(temperature=0.7, seed=2, extra_body={"top_k": 5}),
    dict(temperature=0, presence_penalty=1.0), dict(temperature=0, frequency_penalty=0.8),
    dict(temperature=0, extra_body={"repetition_penalty": 1.3}), dict(temperature=0, logit_bias={"40": 8}),
    dict(temperature=0, extra_body={"min_tokens": 3}), dict(temperature=0, logprobs=2),
    dict(temperature=0, echo=True, logprobs=1), dict(temperature=0.5, seed=3, n=2),
    dict(temperature=0, stop=["e"]), dict(temperature=0, extra_body={"stop_token_ids": [40]}),
])
def test_every_parameter_streams_what_it_answers(client, model, extra):
    extra = dict(extra)
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True} | extra.pop("extra_body", {})
    args = dict(model=model, prompt=["Once upon a time", "A fox"], max_tokens=8, extra_body=body, **extra)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    for c in whole.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert "".join(m.text for m in mine) == c.text and mine[-1].finish_reason == c.finish_reason
        if c.logprobs is not None:
            assert [t for m in mine if m.logprobs for t in m.logprobs.tokens] == c.logprobs.tokens
            streamed = [np.nan if v is None else v for m in mine if m.logprobs for v in m.logprobs.token_logprobs]
            np.testing.assert_allclose(streamed, [np.nan if v is None else v for v in c.logprobs.token_logprobs],
                                       atol=1e-6, equal_nan=True)

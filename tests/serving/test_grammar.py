"""Structured outputs: response_format / guided_* through llguidance, the grammar's bitmask applied in the
one compiled step. Constrained and free requests share a batch and each answers as it does alone
(greedy, with and without MTP drafts, which the grammar may reject); through the openai client, 50
json_schema requests at temperature 1 validate with jsonschema."""

import concurrent.futures
import json
import re
import threading

import jsonschema
import numpy as np
import openai
import pytest

from dsv3_jax import load_pretrained
from dsv3_jax.inference.sampling import allowed_tokens
from dsv3_jax.serving import Engine, Request, Runner, SamplingParams
from dsv3_jax.serving.grammar import GrammarError, request_grammar

PERSON = {  # nested objects, enums, arrays, booleans, integers with bounds: every value short
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 3},
        "home": {"type": "object", "properties": {"floor": {"type": "integer", "minimum": 1, "maximum": 9},
                                                  "lift": {"type": "boolean"}},
                 "required": ["floor", "lift"], "additionalProperties": False},
    },
    "required": ["age", "role", "active", "scores", "home"],
    "additionalProperties": False,
}


def test_bitmask_layout_is_llguidance_s():
    """Bit v % 32 of word v // 32 (little-endian bits of int32 words), as numpy's unpackbits reads them."""
    words = np.random.RandomState(0).randint(-2**31, 2**31, (3, 4), dtype=np.int64).astype(np.int32)
    want = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(3, 128)[:, :100].astype(bool)
    np.testing.assert_array_equal(np.asarray(allowed_tokens(words, 100)), want)


@pytest.mark.parametrize("fields, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_malformed_fields_are_named(fields, field):
    with pytest.raises(GrammarError) as e:
        request_grammar(**fields)
    assert e.value.param == field


PAIR = ([1, 400, 77, 1200, 9], [1, 31, 1500])  # prompts (token ids) of a constrained and a free request


def pair_answers(url: str, model: str, together: bool = True) -> list[list[int]]:
    """Greedy token ids of PAIR[0] under PERSON and of PAIR[1] free, sent at once (or one after the other)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def ask(i):
        extra = {"guided_json": PERSON} if i == 0 else {"ignore_eos": True}
        out = client.completions.create(model=model, prompt=PAIR[i], max_tokens=80 if i == 0 else 24, temperature=0,
                                        logprobs=0, extra_body={**extra, "return_tokens_as_token_ids": True})
        return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

    if not together:
        return [ask(0), ask(1)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(ask, range(2)))


def _engine_answers(engine, jobs):
    """Submits (prompt, params) jobs at once; -> the tokens of each."""
    out, done = [[] for _ in jobs], [threading.Event() for _ in jobs]
    for i, (prompt, params) in enumerate(jobs):
        def sink(ev, i=i):
            out[i].extend(ev.token_ids)
            if ev.finish_reason is not None:
                done[i].set()
        engine.submit(Request(prompt, params, sink))
    assert all(d.wait(300) for d in done), "a request never finished"
    return out


def test_constrained_and_free_requests_share_a_batch(server, model, tok, served_checkpoint):
    """Each answers in a shared batch as alone (greedy); the JSON one validates. An engine with MTP
    drafts gives the same tokens as the server without (the drafts the grammar forbids are rejected)."""
    together = pair_answers(*server)
    assert together == pair_answers(*server, together=False)
    jsonschema.validate(json.loads(tok.decode(together[0])), PERSON)
    assert len(together[1]) == 24
    engine = Engine(Runner(load_pretrained(served_checkpoint), max_batch=2, max_seq_len=128, chunk=16, use_mtp=True),
                    tok)
    engine.start()
    try:
        jobs = [(PAIR[0], SamplingParams(80, grammar=request_grammar(guided_json=PERSON))),
                (PAIR[1], SamplingParams(24, ignore_eos=True))]
        assert _engine_answers(engine, jobs) == together
        assert [_engine_answers(engine, [job])[0] for job in jobs] == together
    finally:
        engine.shutdown()
    assert engine.metrics.proposed_drafts > 0


def test_fifty_json_schema_requests_validate(client, model):
    """Temperature 1, concurrently, through the official client (chat and completions)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(i):
        if i % 2:
            out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"person {i}"}],
                                                 response_format=fmt, temperature=1, seed=i, max_tokens=80)
            return out.choices[0].message.content, out.choices[0].finish_reason
        out = client.completions.create(model=model, prompt=f"person {i}:", temperature=1, seed=i,
                                        max_tokens=80, extra_body={"response_format": fmt})
        return out.choices[0].text, out.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(50)))
    for text, reason in answers:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text, _ in answers}) > 1  # sampled, not one forced answer


def test_json_object_regex_and_choice(client, model):
    """json_object: the served model is untrained and writes one endless string; the budget forces the
    shortest completion as max_tokens runs out, so every answer is an object that ends in time."""
    for seed in range(4):
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "json"}],
                                             response_format={"type": "json_object"}, temperature=1, seed=seed,
                                             max_tokens=24)
        text = out.choices[0].message.content
        assert isinstance(json.loads(text), dict) and out.choices[0].finish_reason == "stop", text
        assert out.usage.completion_tokens <= 24
    regex = r"[a-z]{2,5}-[0-9]{3}"
    out = client.completions.create(model=model, prompt="code:", temperature=1, seed=1, max_tokens=20, n=3,
                                    extra_body={"guided_regex": regex})
    assert all(re.fullmatch(regex, c.text) for c in out.choices), [c.text for c in out.choices]
    choices = ["red", "green", "dark blue"]
    out = client.completions.create(model=model, prompt="colour:", temperature=1, seed=2, max_tokens=20, n=4,
                                    extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices), [c.text for c in out.choices]


def test_an_unbounded_string_ends_within_max_tokens(client, model):
    """A schema string without maxLength, at a max_tokens the model would spend inside it; the schema is
    strict (no property beyond those named) without saying so."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["note", "n"]}
    out = client.completions.create(model=model, prompt="note:", temperature=1, seed=3, max_tokens=20, n=3,
                                    extra_body={"guided_json": schema})
    for c in out.choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), {**schema, "additionalProperties": False})


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_invalid_grammar_is_a_400_naming_the_field(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body

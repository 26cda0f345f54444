"""The shortest completion of a grammar (`completion.Completer`) against completions worked out by hand,
and the budget rule of `grammar.Matcher`: random walks through llguidance's masks, with a token budget,
end with a complete match within the budget (json.loads / jsonschema / re.fullmatch), or, where no
completion fits, at the budget. Strict schemas: additionalProperties false unless a schema sets it."""

import json
import re

import jsonschema
import numpy as np
import pytest

from dsv3_jax.data import load_tokenizer
from dsv3_jax.serving.grammar import Grammars, request_grammar, strict

OBJECT = request_grammar(response_format={"type": "json_object"})


@pytest.fixture(scope="module")
def grammars():
    tok = load_tokenizer()
    return tok, Grammars(tok, tok.vocab_size)


def _at(grammars, grammar: str, prefix: str):
    """A matcher of `grammar` after the tokens of `prefix`."""
    tok, g = grammars
    matcher = g.matcher(grammar)
    for token in tok.encode(prefix) if prefix else []:
        assert not matcher.advance(token), prefix
    return matcher


# prefix -> its shortest completion in tokens' text, by hand: close what is open, the shortest value is 0,
# the shortest key "" (whitespace is not free: compact JSON)
@pytest.mark.parametrize("prefix, completion", [
    ("", "{}"),
    ('{"ab', '":0}'),
    ('{"a"', ":0}"),
    ('{"a":', "0}"),
    ('{"a":1.', "0}"),
    ('{"a":-', "0}"),
    ('{"a":1e', "0}"),
    ('{"a":1,', '"":0}'),
    ('{"a":"\\', '""}'),  # the escape takes a character first
    ('{"a":[{"b":"x', '"}]}'),
    ('{"a":[[', "]]}"),
    ('{"a":tr', "ue}"),
])
def test_shortest_json_completions(grammars, prefix, completion):
    tok, _ = grammars
    matcher = _at(grammars, OBJECT, prefix)
    path, length = matcher._completer.shortest(matcher._m, 20)
    text = tok.decode(path)
    assert text == completion and length == len(path)
    assert isinstance(json.loads(prefix + text), dict)


@pytest.mark.parametrize("fields, prefix, completion", [
    ({"guided_regex": r"[a-z]{3}-[0-9]{2,4}"}, "ab", "a-00"),  # then EOS: the regex may go on
    ({"guided_choice": ["dark blue", "green", "x"]}, "", "x"),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}, "{",
     '"n":0}'),
])
def test_shortest_regex_choice_and_schema_completions(grammars, fields, prefix, completion):
    tok, _ = grammars
    matcher = _at(grammars, request_grammar(**fields), prefix)
    path, _ = matcher._completer.shortest(matcher._m, 20)
    eos = [tok.eos_id] if "guided_regex" in fields else []
    assert path == [t for c in completion for t in tok.encode(c)] + eos


def _walk(grammars, grammar: str, budget: int, seed: int) -> tuple[str, bool]:
    """Tokens drawn uniformly from the rows `Matcher.fill` gives with the budget left; -> (text, complete)."""
    tok, g = grammars
    matcher, rng = g.matcher(grammar), np.random.default_rng(seed)
    row = np.full((1, -(-tok.vocab_size // 32)), -1, np.int32)
    out = []
    while len(out) < budget:
        matcher.fill(row, 0, budget - len(out))
        allowed = np.flatnonzero(np.unpackbits(row[0].view(np.uint8), bitorder="little")[:tok.vocab_size])
        out.append(int(rng.choice(allowed)))
        if matcher.advance(out[-1]):
            return tok.decode([t for t in out if t != tok.eos_id]), True
    return tok.decode(out), False


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                           "items": {"type": "string"}}, "n": {"type": "integer"}},
          "required": ["name", "tags", "n"]}


@pytest.mark.parametrize("budget", [4, 12, 40])
def test_budgeted_walks_end_complete(grammars, budget):
    """A uniform walk never closes a string by chance; the budget makes every walk end a match."""
    for seed in range(3):
        text, complete = _walk(grammars, OBJECT, budget, seed)
        assert complete and isinstance(json.loads(text), dict), text
        text, complete = _walk(grammars, request_grammar(guided_json=SCHEMA), budget + 20, seed)
        assert complete, text
        jsonschema.validate(json.loads(text), strict(SCHEMA))
        text, complete = _walk(grammars, request_grammar(guided_regex=r"[a-z]+(,[a-z]+)*"), budget, seed)
        assert complete and re.fullmatch(r"[a-z]+(,[a-z]+)*", text), text


@pytest.mark.parametrize("budget", [20, 45])
def test_a_branch_that_cannot_end_in_time_is_shut(grammars, budget):
    """After "x" the walk may end or open a group of 30 digits (as a tool call may open another call):
    a group is opened only while the budget still holds it and the end."""
    regex = r"x(,[0-9]{30})*"
    for seed in range(4):
        text, complete = _walk(grammars, request_grammar(guided_regex=regex), budget, seed)
        assert complete and re.fullmatch(regex, text), text


def test_a_budget_under_every_completion_ends_at_the_budget(grammars):
    text, complete = _walk(grammars, request_grammar(guided_json=SCHEMA), 6, 0)
    assert not complete and text.startswith("{")


def test_strict_schemas():
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    assert strict(nested) == {"type": "object", "additionalProperties": False, "properties": {
        "a": {"type": "object", "properties": {}, "additionalProperties": False}}}
    kept = {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}}
    assert strict(kept) == kept
    assert strict({"type": "object"}) == {"type": "object"}  # json_object: any object
    named = {"type": "object", "properties": {"properties": {"enum": [{"properties": {}}]}}}  # names, values
    assert strict(named)["properties"] == named["properties"]

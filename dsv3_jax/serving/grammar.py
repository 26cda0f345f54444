"""Structured outputs: a request's `response_format` / vLLM `guided_*` field as a grammar, and the
per-request matcher that says which tokens may come next.

The grammar engine is llguidance: one abi3 wheel without dependencies (xgrammar needs torch), JSON
schema, regex and Lark grammars, a numpy token bitmask, and it reads the `tokenizers` JSON that every
tokenizer here is (the bundled BPE and HF folders' `tokenizer.json`) directly.

A grammar is llguidance's grammar string (`llguidance.LLMatcher.grammar_from_json_schema`,
`grammar_from_regex`, `grammar_from_lark`), what a request to the engine carries
(`engine.SamplingParams.grammar`). `Grammars` compiles each distinct one once (an LRU of compiled
matchers; a request gets a copy). A `Matcher` fills bitmask rows: int32 [G] words, G = ceil(V / 32),
bit v % 32 of word v // 32 set when token v may come next (what the step's
`sampling.constrained_logits` reads); a free row has every bit set. With MTP drafts the matcher walks
the drafts to fill one row per verified output, and is rolled back before the accepted tokens advance it.
"""

from __future__ import annotations

import collections
import functools
import json
import threading

import llguidance
import llguidance.numpy
import numpy as np

from dsv3_jax.serving.completion import Completer

GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")  # request fields, one at most
ANY_JSON_OBJECT = {"type": "object"}  # response_format json_object: any JSON object
# Compact JSON, no free whitespace: a model cannot pad the output with blanks until max_tokens runs out
# (a schema's own "x-guidance" options override this).
JSON_DEFAULTS = {"whitespace_flexible": False}
SLACK = 16  # budget kept beyond the shortest completion before it is forced (see Matcher)
HORIZON = 128  # budget beyond the shortest completion within which branches that cannot end in time are shut


class GrammarError(ValueError):
    """A structured-output field that does not make a grammar; `param` names it (the 400's)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def request_grammar(response_format: dict | None = None, guided_json: dict | str | None = None,
                    guided_regex: str | None = None, guided_choice: list[str] | None = None, *,
                    grammars: Grammars | None = None) -> str | None:
    """The grammar string of a request's structured-output fields, or None (free text). Raises
    GrammarError naming the field when one is malformed, more than one is set, or (with `grammars`,
    which then keeps it compiled) its grammar does not compile."""
    given = {k: v for k, v in zip(GRAMMAR_FIELDS, (response_format, guided_json, guided_regex, guided_choice))
             if v is not None}
    if len(given) > 1:
        raise GrammarError(list(given)[1], f"give one of {', '.join(given)}, not several")
    grammar, field = _grammar(response_format, guided_json, guided_regex, guided_choice)
    if grammar is not None and grammars is not None:
        grammars.check(grammar, field)
    return grammar


def _grammar(response_format, guided_json, guided_regex, guided_choice) -> tuple[str | None, str | None]:
    """(grammar, the field it comes from) of the one field given; (None, None) for free text."""
    if response_format is not None:
        return _response_format(response_format)
    if guided_json is not None:
        if isinstance(guided_json, str):
            try:
                guided_json = json.loads(guided_json)
            except json.JSONDecodeError as e:
                raise GrammarError("guided_json", f"not JSON: {e}") from None
        return _schema_grammar(guided_json, "guided_json"), "guided_json"
    if guided_regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(guided_regex), "guided_regex"
    if guided_choice is not None:
        if not guided_choice:
            raise GrammarError("guided_choice", "give at least one choice")
        choices = " | ".join(json.dumps(c) for c in guided_choice)
        return llguidance.LLMatcher.grammar_from_lark("start: " + choices), "guided_choice"
    return None, None


def _response_format(fmt: dict) -> tuple[str | None, str | None]:
    kind = fmt.get("type")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return _schema_grammar(ANY_JSON_OBJECT, "response_format"), "response_format"
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise GrammarError("response_format.json_schema", 'give {"name": ..., "schema": {a JSON schema}}')
        field = "response_format.json_schema.schema"
        return _schema_grammar(spec["schema"], field), field
    raise GrammarError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _schema_grammar(schema, field: str) -> str:
    if not isinstance(schema, dict):
        raise GrammarError(field, f"a JSON schema is an object, got {type(schema).__name__}")
    return llguidance.LLMatcher.grammar_from_json_schema(strict(schema), defaults=JSON_DEFAULTS)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("enum", "const", "default", "examples", "required")  # JSON values, not schemas


def strict(schema):
    """`schema` with `"additionalProperties": false` in every object schema (one with `properties`) that
    does not set it, as OpenAI's strict structured outputs: the output holds the properties named and no
    others. Other values, and a schema's own additionalProperties, are kept."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema
            out[key] = {name: strict(s) for name, s in value.items()}
        else:
            out[key] = value if key in _VALUES else strict(value)
    if isinstance(schema.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


class Matcher:
    """One request's place in its grammar (llguidance's matcher), advanced by the tokens it keeps.

    Given the request's token budget, a row forces the first token of the grammar's shortest completion
    (`completion.Completer`) once the budget is within SLACK tokens of that completion's length, and so
    on to its end: the output ends with a complete match. SLACK covers the structure one free token may
    open (`{"` needs `":0}`); a token that opens more (a second tool call) is shut out beforehand: within
    HORIZON of the end, where the grammar branches a few ways (`completion.Completer.dead_ends`), the
    ways with no completion left in the budget are masked. A budget smaller than any completion leaves
    the row free (the request ends at "length"). A completion found is kept while it still ends the grammar from where the output is
    (the output follows it, or a string goes on); a new one is searched when it does not, or when the
    budget comes within SLACK of it. After a search finds none, none is searched again until the budget
    reaches a lower bound on its length (each byte kept lowers it by at most one)."""

    def __init__(self, matcher: llguidance.LLMatcher, completer: Completer):
        self._m, self._completer = matcher, completer
        self._tokens: list[int] = []  # consumed so far, drafts included until rolled back
        self._plan: tuple[tuple[int, ...], list[int] | None, int] | None = None  # (at tokens, completion, least length)

    def fill(self, rows_xG: np.ndarray, index: int, budget: int) -> None:
        """Row `index` of rows_xG: the tokens that may come next with `budget` tokens left."""
        llguidance.numpy.fill_next_token_bitmask(self._m, rows_xG, index)
        forced, length = self._forced(budget)
        if forced is not None:
            rows_xG[index] = 0
            rows_xG[index, forced >> 5] = np.array(1 << (forced & 31), np.uint32).view(np.int32)
        elif length is not None and budget <= length + HORIZON:
            dead = self._completer.dead_ends(self._m, budget)
            words_G = rows_xG[index].view(np.uint32)
            np.bitwise_and.at(words_G, dead >> 5, ~(np.uint32(1) << (dead & 31).astype(np.uint32)))

    def _forced(self, budget: int) -> tuple[int | None, int | None]:
        """(the token `budget` forces next, or None while the output is free; the length of the
        completion known, None where none fits)."""
        if self._plan is not None and tuple(self._tokens[:len(self._plan[0])]) == self._plan[0]:
            made, path, least = self._plan
            since = self._tokens[len(made):]
            if path is not None and since == path[:len(since)]:
                return _due(path[len(since):], budget), len(path) - len(since)
            if path is not None and budget > len(path) + SLACK and self._completer.completes(self._m, path):
                self._plan = (tuple(self._tokens), path, len(path))  # it still ends the grammar, in time
                return None, len(path)
            if path is None and budget < least - int(self._completer.token_bytes_V[since].sum()):
                return None, None  # no completion fits
        path, searched = self._completer.shortest(self._m, budget)
        self._plan = (tuple(self._tokens), path, searched if path is not None else searched + 1)
        return (None, None) if path is None else (_due(path, budget), len(path))

    def fill_drafts(self, drafts_M: np.ndarray, rows_KxG: np.ndarray, budget: int) -> int:
        """Rows 0 .. of rows_KxG along the draft path: row i after drafts 0 .. i - 1, while the rows allow
        them (the row before a draft it refuses forbids that draft; later rows are left as they are).
        Returns the drafts taken: `rollback` them after the step."""
        self.fill(rows_KxG, 0, budget)
        taken = 0
        for draft in drafts_M.tolist():
            allowed = (int(rows_KxG[taken, draft >> 5]) >> (draft & 31)) & 1
            if not allowed or self._m.is_stopped() or self._m.try_consume_tokens([draft]) != 1:
                break
            self._tokens.append(draft)
            taken += 1
            self.fill(rows_KxG, taken, budget - taken)
        return taken

    def rollback(self, tokens: int) -> None:
        if tokens:
            self._m.rollback(tokens)
            del self._tokens[-tokens:]

    def advance(self, token: int) -> bool:
        """Takes a kept token; True when the grammar is complete (or the token broke it): the request ends."""
        self._m.consume_token(token)
        self._tokens.append(token)
        return self._m.is_stopped() or self._m.is_error()


def _due(completion: list[int], budget: int) -> int | None:
    """The completion's next token once `budget` is within SLACK of its length."""
    return completion[0] if completion and budget <= len(completion) + SLACK else None


class Grammars:
    """The grammars of one tokenizer and vocabulary, each compiled once (`cache` most recent kept)."""

    def __init__(self, tokenizer, vocab_size: int, cache: int = 64):
        self._tokenizer, self.vocab_size, self._cache = tokenizer, vocab_size, cache
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()  # the server's request threads check, the engine thread makes matchers

    @functools.cached_property
    def _lltokenizer(self) -> llguidance.LLTokenizer:
        # the tokenizer's JSON (HF `tokenizers`), with the model's vocabulary size and EOS
        if self._tokenizer.vocab_size > self.vocab_size:
            raise GrammarError("grammar", f"the tokenizer has {self._tokenizer.vocab_size} tokens, more than the "
                                          f"model's vocab_size={self.vocab_size}")
        return llguidance.LLTokenizer(self._tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                      eos_token=self._tokenizer.eos_id)

    @functools.cached_property
    def _completer(self) -> Completer:
        return Completer(self._lltokenizer, self.vocab_size, self._tokenizer.eos_id)

    def check(self, grammar: str, field: str = "grammar") -> llguidance.LLMatcher:
        """The compiled grammar (kept for its requests); GrammarError naming `field` if it does not compile."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
            compiled = llguidance.LLMatcher(self._lltokenizer, grammar)
            if compiled.is_error():
                raise GrammarError(field, compiled.get_error())
            self._compiled[grammar] = compiled
            if len(self._compiled) > self._cache:
                self._compiled.popitem(last=False)
            return compiled

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher at the grammar's start (a copy of the compiled one)."""
        compiled = self.check(grammar)
        with self._lock:
            return Matcher(compiled.deep_copy(), self._completer)

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

GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")  # request fields, one at most
ANY_JSON_OBJECT = {"type": "object"}  # response_format json_object: any JSON object
# Compact JSON, no free whitespace: a model cannot pad the output with blanks until max_tokens runs out
# (a schema's own "x-guidance" options override this).
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A structured-output field that does not make a grammar; `field` names it (the 400's param)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


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
    made = _grammar(response_format, guided_json, guided_regex, guided_choice)
    if made is None:
        return None
    grammar, field = made
    if grammars is not None:
        grammars.check(grammar, field)
    return grammar


def _grammar(response_format, guided_json, guided_regex, guided_choice) -> tuple[str, str] | None:
    """(grammar, the field it comes from) of the one field given, or None."""
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
    return None


def _response_format(fmt: dict) -> tuple[str, str] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
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
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)


class Matcher:
    """One request's place in its grammar (llguidance's matcher), advanced by the tokens it keeps."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def fill(self, rows_xG: np.ndarray, index: int = 0) -> None:
        """Row `index` of rows_xG: the tokens that may come next."""
        llguidance.numpy.fill_next_token_bitmask(self._m, rows_xG, index)

    def fill_drafts(self, drafts_M: np.ndarray, rows_KxG: np.ndarray) -> int:
        """Rows 0 .. of rows_KxG along the draft path: row i after drafts 0 .. i - 1, while the grammar
        takes them (the row before a draft it refuses forbids that draft; later rows are left as they
        are). Returns the drafts taken: `rollback` them after the step."""
        self.fill(rows_KxG, 0)
        taken = 0
        for draft in drafts_M.tolist():
            if self._m.is_stopped() or self._m.try_consume_tokens([draft]) != 1:
                break
            taken += 1
            self.fill(rows_KxG, taken)
        return taken

    def rollback(self, tokens: int) -> None:
        if tokens:
            self._m.rollback(tokens)

    def advance(self, token: int) -> bool:
        """Takes a kept token; True when the grammar is complete (or the token broke it): the request ends."""
        self._m.consume_token(token)
        return self._m.is_stopped() or self._m.is_error()


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

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
            compiled = llguidance.LLMatcher(self._lltokenizer, grammar)
            if not compiled.is_error():
                self._compiled[grammar] = compiled
                if len(self._compiled) > self._cache:
                    self._compiled.popitem(last=False)
            return compiled

    def check(self, grammar: str, field: str) -> None:
        """Compiles the grammar (kept for its requests); GrammarError naming `field` if it does not compile."""
        compiled = self._compile(grammar)
        if compiled.is_error():
            raise GrammarError(field, compiled.get_error())

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher at the grammar's start (a copy of the compiled one)."""
        compiled = self._compile(grammar)
        if compiled.is_error():
            raise GrammarError("grammar", compiled.get_error())
        with self._lock:
            return Matcher(compiled.deep_copy())

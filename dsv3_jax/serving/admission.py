"""What an OpenAI request asks, checked against this server and turned into the engine's `SamplingParams`.

Every refusal is a `BadRequest` carrying its HTTP status and the field it names (the server answers it as
OpenAI's error shape): an unknown model (404), token ids outside the vocabulary, a prompt that leaves the
context no room, options this server does not implement, and the penalties that MTP speculation cannot
apply to its drafts.
"""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np

from dsv3_jax.inference.sampling import MAX_LOGPROBS
from dsv3_jax.serving import schemas
from dsv3_jax.serving.engine import SamplingParams
from dsv3_jax.serving.grammar import GRAMMAR_FIELDS, Grammars, request_grammar
from dsv3_jax.serving.penalties import Penalties

# Fields whose off value MTP speculation needs: a verify window would need the drafts' own penalties.
_OFF_UNDER_MTP = (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1), ("min_tokens", 0))


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def choice_seed(seed: int, j: int) -> int:
    """Choice j's seed: the request's own for j = 0, else one mixed from (seed, j)."""
    return seed if j == 0 else int(np.random.SeedSequence([seed, j]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class Admission:
    """The checks that depend on what this server runs: its model's name, context, vocabulary and engine."""

    model_name: str
    context: int  # tokens a request may hold: prompt + max_tokens
    vocab: int
    eos_ids: tuple[int, ...]
    speculates: bool  # MTP drafts are verified (the penalties in `_OFF_UNDER_MTP` are refused)
    grammars: Grammars

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise BadRequest(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                             "model")

    def check_ids(self, ids, field: str) -> None:
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab:
            raise BadRequest(400, f"{field}: token ids must lie in [0, vocab_size={self.vocab})", field)

    def max_tokens(self, ids: list[int], asked: int | None, default: int | None) -> int:
        """The request's generation budget: `asked`, else `default` (else the room left), within the context."""
        if not ids:
            raise BadRequest(400, "the prompt is empty (it must encode to at least one token)", "prompt")
        room = self.context - len(ids)
        if room < (1 if asked != 0 else 0):
            raise BadRequest(400, f"the prompt has {len(ids)} tokens; the context holds {self.context} "
                                  "(prompt + max_tokens) and leaves no room to generate", "prompt")
        self.check_ids(ids, "prompt")
        budget = asked if asked is not None else min(default or room, room)
        if len(ids) + budget > self.context:
            raise BadRequest(400, f"prompt ({len(ids)} tokens) + max_tokens ({budget}) exceeds the context "
                                  f"length {self.context}; lower max_tokens or shorten the prompt", "max_tokens")
        return budget

    def sampling(self, req: schemas._Sampling, max_tokens: int, logprobs: int | None,
                 echo: bool = False) -> SamplingParams:
        """The engine's parameters for one choice of `req` (its seed drawn here when the request sets none)."""
        self._check_options(req)
        if req.prompt_logprobs is not None:  # scored by the prefill; ranks need the step's whole top list
            if req.stream:
                raise BadRequest(400, "prompt_logprobs cannot be streamed", "prompt_logprobs")
            echo, logprobs = True, MAX_LOGPROBS
        stop_ids = tuple(req.stop_token_ids or ())
        penalties = Penalties(req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
                              tuple((req.logit_bias or {}).items()), req.min_tokens,
                              stop_ids + (() if req.ignore_eos else self.eos_ids))
        grammar = request_grammar(*(getattr(req, k) for k in GRAMMAR_FIELDS), grammars=self.grammars)
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed if req.seed is not None else uuid.uuid4().int % 2**32,
                              stop=tuple(req.stop_strings()), stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
                              logprobs=logprobs, echo=echo, penalties=penalties, prefix_cache=req.prefix_cache,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              skip_special_tokens=req.skip_special_tokens, grammar=grammar)

    def _check_options(self, req: schemas._Sampling) -> None:
        self.check_model(req.model)
        bad = req.unsupported()
        if bad:
            raise BadRequest(400, f"unsupported option(s): {', '.join(bad)}", bad[0])
        self.check_ids(tuple(req.stop_token_ids or ()), "stop_token_ids")
        self.check_ids(list(req.logit_bias or {}), "logit_bias")
        used = [k for k, off in _OFF_UNDER_MTP if self.speculates and getattr(req, k) != off]
        if used:
            raise BadRequest(400, f"{used[0]} is not supported with MTP speculation (--use_mtp)", used[0])

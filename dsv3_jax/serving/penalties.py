"""Host-side penalty tables of the engine's slots: the sparse [B, P] columns that
`dsv3_jax.inference.sampling.penalized_logits` applies (its module docstring states the rule),
updated in O(1) per generated token.

A slot's columns: the prompt's distinct tokens (when it has a repetition penalty), its logit_bias
tokens, the tokens min_tokens bans (EOS and stop_token_ids), and each distinct output token (when
it has any penalty). P = context + MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + 1 columns always suffice.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from dsv3_jax.inference.sampling import RowSampling

MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids one request may give


def table_width(context: int) -> int:
    return context + MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + 1


@dataclasses.dataclass(frozen=True)
class Penalties:
    """One request's penalty parameters (OpenAI / vLLM semantics)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    banned: tuple[int, ...] = ()  # what min_tokens bans: EOS (unless ignored) and the stop token ids

    @property
    def on_output(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


@dataclasses.dataclass
class _Slot:
    p: Penalties
    seen_in_prompt: set
    bias: dict
    columns: dict = dataclasses.field(default_factory=dict)  # token -> column
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    generated: int = 0


class PenaltyTables:
    """Keeps `sampling`'s penalty columns (numpy [B, P], changed in place) in step with each slot."""

    def __init__(self, sampling: RowSampling):
        self.s = sampling
        self.slots: list[_Slot | None] = [None] * sampling.penalty_ids.shape[0]

    def start(self, slot: int, prompt: list[int], p: Penalties) -> None:
        self.clear(slot)
        state = self.slots[slot] = _Slot(p, set(prompt) if p.repetition != 1 else set(), dict(p.logit_bias))
        for token in state.seen_in_prompt | set(state.bias) | (set(p.banned) if p.min_tokens > 0 else set()):
            self._write(slot, token)

    def observe(self, slot: int, tokens: list[int]) -> None:
        state = self.slots[slot]
        if state is None:
            return
        for token in tokens:
            state.generated += 1
            if state.p.on_output:
                state.counts[token] += 1
                self._write(slot, token)
            if state.generated == state.p.min_tokens:  # the ban ends
                for banned in state.p.banned:
                    self._write(slot, banned)

    def clear(self, slot: int) -> None:
        self.slots[slot] = None
        self.s.penalty_ids[slot], self.s.penalty_add[slot], self.s.penalty_scale[slot] = 0, 0.0, 1.0

    def _write(self, slot: int, token: int) -> None:
        state = self.slots[slot]
        p, count = state.p, state.counts[token]
        add = state.bias.get(token, 0.0) - p.frequency * count - p.presence * (count > 0)
        if token in p.banned and state.generated < p.min_tokens:
            add = -np.inf
        scale = p.repetition if (token in state.seen_in_prompt or count > 0) else 1.0
        column = state.columns.setdefault(token, len(state.columns))
        self.s.penalty_ids[slot, column], self.s.penalty_add[slot, column] = token, add
        self.s.penalty_scale[slot, column] = scale

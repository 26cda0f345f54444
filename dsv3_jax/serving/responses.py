"""OpenAI-shaped response bodies: completions and chat, whole or as stream chunks, with log-probabilities.

A `Choice` gathers one generated sequence's engine events (text, tokens, their log-probabilities,
with echo the prompt's). Log-probabilities come out in OpenAI's two shapes:

- completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per token;
  an echoed prompt's first token has no context, so its `token_logprobs` and `top_logprobs` entries
  are null. `top_logprobs` maps token text to log-probability: the `logprobs` most likely tokens,
  plus the chosen token when it is not among them (as vLLM does, so `logprobs=0` still names it).
  `text_offset` is each token's character offset in the choice's text (the echoed prompt first).
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

vLLM's `prompt_logprobs` (k) come in vLLM's shape: one entry per prompt token, the first null, each
`{token id: {"logprob", "rank", "decoded_token"}}` for the prompt token and the k most likely, in a
completions choice or, for chat, beside the choices. A rank is 1 + the number of tokens more likely;
the step returns the 20 most likely, so the rank of a prompt token outside them is null.

A chat answer read for tool calls (`tools.ToolCallStream`) holds the text before the calls as its
content and the calls as OpenAI `tool_calls` (deltas when streamed); it ends with `finish_reason`
"tool_calls" when it stopped after calling.

A token is named by its text, or `token_id:N` when the request sets vLLM's `return_tokens_as_token_ids`
(texts of byte pieces and equal texts of different ids are ambiguous; ids are not).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

from dsv3_jax.data.tokenizer import Tokenizer
from dsv3_jax.serving import tools
from dsv3_jax.serving.engine import Event, Logprob


@dataclasses.dataclass
class Choice:
    """One sequence of a response: prompt `index`-th choice, as the engine's events arrive."""

    index: int
    prompt: list[int]
    echo_text: str = ""  # the prompt text echoed before the completion ("" without echo)
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    tool_calls: tools.ToolCallStream | None = None  # chat with tools: reads calls out of the text (one per sequence)

    def add(self, ev: Event) -> None:
        self.text += ev.text
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs or []
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        self.finish_reason, self.completion_tokens = ev.finish_reason, ev.completion_tokens

    def cumulative_logprob(self) -> float:
        return sum(lp for lp, _ in self.logprobs)


def namer(tok: Tokenizer, as_ids: bool) -> Callable[[int], str]:
    """How a response names a token: its text, or `token_id:N`."""
    return (lambda i: f"token_id:{i}") if as_ids else (lambda i: tok.decode([i]))


def completion_logprobs(name: Callable[[int], str], ids: list[int], entries: list[Logprob | None], top: int,
                        offset: int = 0) -> dict:
    """OpenAI completions shape for tokens `ids` (entries aligned with them); offsets start at `offset`."""
    tokens = [name(i) for i in ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens), initial=offset))[:-1]  # each token's start

    def top_logprobs(i: int, e: Logprob) -> dict:
        out = {}
        for t, lp in e[1][:top] + [(i, e[0])]:  # most likely first: of tokens with equal text the likelier stays
            out.setdefault(name(t), lp)
        return out

    return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else top_logprobs(i, e) for i, e in zip(ids, entries)],
            "text_offset": offsets}


def chat_logprobs(name: Callable[[int], str], ids: list[int], entries: list[Logprob], top: int) -> dict:
    def item(token_id: int, lp: float) -> dict:
        text = name(token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [item(i, e[0]) | {"top_logprobs": [item(t, lp) for t, lp in e[1][:top]]}
                        for i, e in zip(ids, entries)]}


def completion_choice(name: Callable[[int], str], c: Choice, top: int | None, *, echo_prompt: bool,
                      offset: int = 0) -> dict:
    """A completions choice (of a stream chunk: `c` holds the chunk's share of text, ids and logprobs)."""
    text, ids, entries = c.text, c.token_ids, c.logprobs
    if echo_prompt:
        text = c.echo_text + text
        if top is not None:
            ids, entries = c.prompt + ids, (c.prompt_logprobs or [None] * len(c.prompt)) + entries
    logprobs = None if top is None else completion_logprobs(name, ids, entries, top, offset)
    return {"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": logprobs}


def prompt_logprobs(tok: Tokenizer, prompt: list[int], entries: list[Logprob | None], k: int) -> list[dict | None]:
    """vLLM's shape of the prompt tokens' log-probabilities (the module docstring)."""

    def item(lp: float, rank: int | None, token: int) -> dict:
        return {"logprob": lp, "rank": rank, "decoded_token": tok.decode([token])}

    out = [None]
    for token, (lp, top) in zip(prompt[1:], entries[1:]):
        rank = sum(v >= lp for _, v in top) if top and lp >= top[-1][1] else None
        ranked = {token: item(lp, rank, token)}
        for r, (t, v) in enumerate(top[:k]):
            ranked.setdefault(t, item(v, r + 1, t))
        out.append({str(t): v for t, v in ranked.items()})
    return out


def chat_choice(name: Callable[[int], str], c: Choice, top: int | None, *, chunk: bool, first: bool = False) -> dict:
    """A chat choice (of a stream chunk: `c` holds the chunk's share of text, ids and logprobs; its tool-call
    reader, shared by the chunks of a sequence, reads each share once)."""
    logprobs = None if top is None else chat_logprobs(name, c.token_ids, c.logprobs, top)
    content, calls, finish = c.text, [], c.finish_reason
    if c.tool_calls is not None:
        content, calls = c.tool_calls.push(c.text, final=finish is not None)
        finish = "tool_calls" if finish == "stop" and c.tool_calls.calls else finish
    if first or not chunk:
        content = c.echo_text + content
    if chunk:
        delta = {"role": "assistant", "content": content} if first else {"content": content}
        if calls:
            delta["tool_calls"] = calls
        return {"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    message = {"role": "assistant", "content": content}
    if calls:
        message |= {"content": content or None, "tool_calls": tools.merged(calls)}
    return {"index": c.index, "message": message, "finish_reason": finish, "logprobs": logprobs}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def body(rid: str, model: str, choices: list[dict], use: dict | None, *, chat: bool, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out

"""Engine events into one HTTP response: gathered whole, or streamed as server-sent events.

Each choice of a response is its own engine request; their events arrive on one asyncio queue as
(choice, event). Either way the response's requests are cancelled when it ends: a no-op for those that
finished, and the freeing of their slots when the client went away (a closed stream, a disconnect).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json

import fastapi

from dsv3_jax.serving import responses
from dsv3_jax.serving.engine import Engine, Request
from dsv3_jax.serving.responses import Choice


async def gather(engine: Engine, http: fastapi.Request, queue: asyncio.Queue, requests: list[Request],
                 n_choices: int) -> bool:
    """Feeds every event to its choice until all finish; False if the client went away."""
    finished = 0
    try:
        while finished < n_choices:
            try:
                c, ev = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    return False
                continue
            c.add(ev)
            finished += ev.finish_reason is not None
    finally:
        for r in requests:
            engine.cancel(r)
    return True


def best(choices: list[Choice], keep: int) -> list[Choice]:
    """Per prompt (runs of equal prompt), the `keep` choices of highest cumulative logprob, renumbered."""
    out = []
    for i, (_, group) in enumerate(itertools.groupby(choices, key=lambda c: id(c.prompt))):
        ranked = sorted(group, key=lambda c: -c.cumulative_logprob())[:keep]
        out += [dataclasses.replace(c, index=i * keep + j) for j, c in enumerate(ranked)]
    return out


async def sse(engine: Engine, name, requests: list[Request], queue: asyncio.Queue, choices: list[Choice], rid: str,
              model: str, chat_api: bool, top: int | None, echo: bool, prompt_tokens: int | None):
    """Server-sent events of one response; cancels its requests when the client goes away (generator closed)."""
    started, offsets, finished = set(), {}, 0
    try:
        while finished < len(choices):
            c, ev = await queue.get()
            c.add(ev)
            finished += ev.finish_reason is not None
            first = c.index not in started
            if not (ev.text or ev.token_ids or ev.finish_reason is not None or first):
                continue
            share = dataclasses.replace(c, text=ev.text, token_ids=ev.token_ids, logprobs=ev.logprobs or [])
            if chat_api:
                out = responses.chat_choice(name, share, top, chunk=True, first=first)
            else:
                out = responses.completion_choice(name, share, top, echo_prompt=echo and first,
                                                  offset=offsets.get(c.index, 0))
                if out["logprobs"] is not None:
                    offsets[c.index] = sum(map(len, out["logprobs"]["tokens"])) + offsets.get(c.index, 0)
            started.add(c.index)
            yield _event(responses.body(rid, model, [out], None, chat=chat_api, chunk=True))
        if prompt_tokens is not None:
            use = responses.usage(prompt_tokens, sum(c.completion_tokens for c in choices))
            yield _event(responses.body(rid, model, [], use, chat=chat_api, chunk=True))
        yield "data: [DONE]\n\n"
    finally:
        for r in requests:
            engine.cancel(r)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"

"""The OpenAI-compatible HTTP layer (FastAPI) over an `Engine`.

GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (`stream=true`:
server-sent events, `data: {chunk}` ... `data: [DONE]`), vLLM's POST /tokenize, POST /detokenize and
GET /tokenizer_info, GET /health, GET /metrics (Prometheus text). Chat with `tools`: calls are read out of
the answer, and forced by a grammar for tool_choice "required" or a named function (`tools`).

Prompts: a text prompt is encoded with the tokenizer's BOS in front (the training layout; what
DeepSeek-V3's tokenizer does under HF's `add_special_tokens`); a token-id prompt is scored and
continued verbatim, nothing added (as vLLM does, and as lm-evaluation-harness's token mode relies
on). `/tokenizer_info`'s `add_bos_token` says whether the tokenizer file puts BOS in front itself (its
post-processor), as a client that loads the file with transformers gets it. A completions request may
carry several prompts (texts or id lists) and ask `n` choices of each: choice `index` = prompt number * n
+ choice number, each its own engine request. With `best_of`, that many are generated per prompt and
the `n` with the highest cumulative log-probability returned. Choice j > 0 of a seeded request draws
with a seed derived from (seed, j), so n choices differ and the whole response is reproducible.

Errors are OpenAI-shaped `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON,
bad values (the field named; `schemas` parses strictly), a prompt that does not fit the context, unsupported
options; 404 for an unknown model or route; 413 for a body over `max_request_bytes`, refused at its first read
(by its Content-Length, or as its chunks arrive) so that it is never held whole; 429 when the queue is full;
500 if the engine fails. A client that disconnects (streaming or not) cancels its requests, which frees their
slots at once.

The event loop only routes: texts are tokenized (and chats rendered) in worker threads, with the tokenizer's
`encode_batch`, which lets go of the GIL, so that a long prompt delays neither /health nor other streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
import uuid

import fastapi
import numpy as np
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from dsv3_jax.inference.sampling import MAX_LOGPROBS
from dsv3_jax.serving import responses, schemas, tools
from dsv3_jax.serving.chat import ChatTemplateError, ChatTokenizer
from dsv3_jax.serving.engine import Engine, EngineFailed, QueueFull, Request, SamplingParams
from dsv3_jax.serving.grammar import GRAMMAR_FIELDS, GrammarError, request_grammar
from dsv3_jax.serving.penalties import Penalties
from dsv3_jax.serving.responses import Choice

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_REQUEST_BYTES = 4 * 2**20  # a body over this is refused (413): far above any context's worth of text


_ERROR_KINDS = {404: "not_found_error", 429: "rate_limit_error", 500: "internal_error"}  # else invalid_request_error


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def choice_seed(seed: int, j: int) -> int:
    """Choice j's seed: the request's own for j = 0, else one mixed from (seed, j)."""
    return seed if j == 0 else int(np.random.SeedSequence([seed, j]).generate_state(1)[0])


def limit_body(app, max_bytes: int):
    """ASGI middleware: a request body over `max_bytes` raises 413 at its first read when its Content-Length says
    so, else as soon as its chunks pass the limit; nothing beyond that is read."""

    def check(size: int) -> None:
        if size > max_bytes:
            raise HTTPException(413, f"the request body is over this server's limit of {max_bytes} bytes "
                                     "(max_request_bytes)")

    async def limited(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        declared, seen = int(dict(scope["headers"]).get(b"content-length", 0)), 0

        async def receive_at_most():
            nonlocal seen
            check(declared)
            message = await receive()
            seen += len(message.get("body", b""))
            check(seen)
            return message

        await app(scope, receive_at_most, send)

    return limited


def make_app(engine: Engine, chat: ChatTokenizer, model_name: str,
             max_request_bytes: int = MAX_REQUEST_BYTES) -> fastapi.FastAPI:
    app = fastapi.FastAPI(title="dsv3-jax", docs_url=None, redoc_url=None)
    app.add_middleware(limit_body, max_bytes=max_request_bytes)
    tok, max_seq_len, vocab = chat.tokenizer, engine.runner.context, engine.runner.config.vocab_size
    model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "dsv3-jax",
                  "max_model_len": max_seq_len}
    adds_bos = tok.hf.encode("a").ids[:1] == [tok.bos_id]  # the file's post-processor puts BOS in front

    def error(status: int, message: str, param: str | None = None):
        engine.metrics.response(status)
        kind = _ERROR_KINDS.get(status, "invalid_request_error")
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return error(400, f"malformed JSON body: {first.get('msg')}")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "").removeprefix("Value error, ")
        return error(400, f"{where}: {message}" if where else message, param=where or None)

    @app.exception_handler(BadRequest)
    @app.exception_handler(GrammarError)  # a structured output or tool_choice that makes no grammar: a 400
    async def _bad(_, exc: BadRequest | GrammarError):
        return error(getattr(exc, "status", 400), str(exc), exc.param)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise BadRequest(404, f"the model {name!r} does not exist; this server serves {model_name!r}", "model")

    def check_ids(ids: list[int], field: str) -> None:
        if ids and not 0 <= min(ids) <= max(ids) < vocab:
            raise BadRequest(400, f"{field}: token ids must lie in [0, vocab_size={vocab})", field)

    def check_prompt(ids: list[int], max_tokens: int | None, default: int | None) -> int:
        if not ids:
            raise BadRequest(400, "the prompt is empty (it must encode to at least one token)", "prompt")
        room = max_seq_len - len(ids)
        if room < (1 if max_tokens != 0 else 0):
            raise BadRequest(400, f"the prompt has {len(ids)} tokens; the context holds {max_seq_len} "
                                  "(prompt + max_tokens) and leaves no room to generate", "prompt")
        check_ids(ids, "prompt")
        max_tokens = max_tokens if max_tokens is not None else min(default or room, room)
        if len(ids) + max_tokens > max_seq_len:
            raise BadRequest(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                  f"length {max_seq_len}; lower max_tokens or shorten the prompt", "max_tokens")
        return max_tokens

    async def encode(texts: list[str]) -> list[list[int]]:
        """The texts' ids (no special tokens), from a worker thread."""
        return await asyncio.to_thread(tok.encode_batch, texts)

    async def encode_chat(body: schemas.ChatRequest | schemas.TokenizeRequest) -> list[int]:
        """The rendered chat's ids: `tools` passed as HF passes them, vLLM's chat_template_kwargs over them."""
        tool_list = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        variables = {"tools": tool_list} | (body.chat_template_kwargs or {})
        try:
            text = await asyncio.to_thread(chat.render, [m.for_template() for m in body.messages],
                                           add_generation_prompt=body.add_generation_prompt, **variables)
        except (ChatTemplateError, ValueError) as e:
            raise BadRequest(400, str(e), "messages") from e
        return (await encode([text]))[0]

    def params(req: schemas._Sampling, max_tokens: int, logprobs: int | None, echo: bool = False) -> SamplingParams:
        check_model(req.model)
        bad = req.unsupported()
        if bad:
            raise BadRequest(400, f"unsupported option(s): {', '.join(bad)}", bad[0])
        stop_ids = tuple(req.stop_token_ids or ())
        check_ids(stop_ids, "stop_token_ids")
        check_ids(list(req.logit_bias or {}), "logit_bias")
        if engine.runner.drafts:  # a verify window would need the drafts' own penalties: not implemented
            used = [k for k, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                                     ("min_tokens", 0)) if getattr(req, k) != off]
            if used:
                raise BadRequest(400, f"{used[0]} is not supported with MTP speculation (--use_mtp)", used[0])
        if req.prompt_logprobs is not None:  # scored by the prefill; ranks need the step's whole top list
            if req.stream:
                raise BadRequest(400, "prompt_logprobs cannot be streamed", "prompt_logprobs")
            echo, logprobs = True, MAX_LOGPROBS
        penalties = Penalties(req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
                              tuple((req.logit_bias or {}).items()), req.min_tokens,
                              stop_ids + (() if req.ignore_eos else engine.eos_ids))
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed if req.seed is not None else uuid.uuid4().int % 2**32,
                              stop=tuple(req.stop_strings()), stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
                              logprobs=logprobs, echo=echo, penalties=penalties, prefix_cache=req.prefix_cache,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              skip_special_tokens=req.skip_special_tokens,
                              grammar=request_grammar(*(getattr(req, k) for k in GRAMMAR_FIELDS),
                                                      grammars=engine.grammars))

    async def gather(http: fastapi.Request, queue: asyncio.Queue, requests: list[Request], n_choices: int) -> bool:
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
                engine.cancel(r)  # no-op once finished; frees the slot if the client went away
        return True

    async def run(http, choices: list[Choice], per_choice: list[SamplingParams], req, *, chat_api: bool,
                  top: int | None, echo: bool = False, keep: int | None = None):
        """Generates every choice; answers with the first `keep` per prompt by cumulative logprob (best_of)."""
        queue, loop, requests = asyncio.Queue(), asyncio.get_running_loop(), []
        try:
            for c, sp in zip(choices, per_choice):
                sink = lambda ev, c=c: loop.call_soon_threadsafe(queue.put_nowait, (c, ev))  # noqa: E731
                requests.append(engine.submit(Request(list(c.prompt), sp, sink)))
        except Exception as e:  # the queue is full, the engine failed or a grammar failed: none of them runs
            for r in requests:
                engine.cancel(r)
            if isinstance(e, (QueueFull, EngineFailed)):
                return error(429 if isinstance(e, QueueFull) else 503, str(e))
            raise
        rid = ("chatcmpl-" if chat_api else "cmpl-") + uuid.uuid4().hex[:24]
        prompt_tokens = sum(len(p) for p in {id(c.prompt): c.prompt for c in choices}.values())
        name = responses.namer(tok, req.return_tokens_as_token_ids)
        if req.stream:
            engine.metrics.response(200)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = _sse(engine, name, requests, queue, choices, rid, model_name, chat_api, top, echo,
                          prompt_tokens if include_usage else None)
            return StreamingResponse(stream, media_type="text/event-stream")
        if not await gather(http, queue, requests, len(choices)):
            return None
        if any(c.finish_reason == "error" for c in choices):
            return error(500, "the engine failed on this request (see the server log)")
        use = responses.usage(prompt_tokens, sum(c.completion_tokens for c in choices))
        if keep is not None:
            choices = _best(choices, keep)
        if chat_api:
            out = [responses.chat_choice(name, c, top, chunk=False) for c in choices]
        else:
            out = [responses.completion_choice(name, c, top, echo_prompt=echo) for c in choices]
        payload = responses.body(rid, model_name, out, use, chat=chat_api, chunk=False)
        if req.prompt_logprobs is not None:  # vLLM's places: beside the chat choices, in each completions choice
            scored = [responses.prompt_logprobs(tok, c.prompt, c.prompt_logprobs, req.prompt_logprobs) for c in choices]
            for o, p in zip([payload] if chat_api else out, scored):
                o["prompt_logprobs"] = p
        engine.metrics.response(200)
        return JSONResponse(payload)

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, http: fastapi.Request):
        prompts = body.prompts()
        if not prompts:
            raise BadRequest(400, "prompt: give at least one prompt", "prompt")
        if body.max_tokens == 0 and not body.echo:
            raise BadRequest(400, "max_tokens=0 generates nothing: it is only allowed with echo", "max_tokens")
        best_of = body.best_of or body.n
        if best_of < body.n:
            raise BadRequest(400, f"best_of ({best_of}) must be >= n ({body.n})", "best_of")
        if best_of > body.n and body.stream:
            raise BadRequest(400, "best_of > n cannot be streamed (the best are known only at the end)", "best_of")
        top = body.logprobs if best_of == body.n else (body.logprobs or 0)  # best_of ranks by logprob
        choices, per_choice = [], []
        encoded = iter(await encode([p for p in prompts if isinstance(p, str)]))
        for i, prompt in enumerate(prompts):
            ids = [tok.bos_id] + next(encoded) if isinstance(prompt, str) else list(prompt)
            sp = params(body, check_prompt(ids, body.max_tokens, DEFAULT_COMPLETION_TOKENS), top,
                        echo=body.echo and body.logprobs is not None)
            echo_text = (prompt if isinstance(prompt, str) else tok.decode(ids)) if body.echo else ""
            for j in range(best_of):
                choices.append(Choice(i * best_of + j, ids, echo_text))
                per_choice.append(dataclasses.replace(sp, seed=choice_seed(sp.seed, j)))
        return await run(http, choices, per_choice, body, chat_api=False, top=body.logprobs, echo=body.echo,
                         keep=body.n if best_of > body.n else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatRequest, http: fastapi.Request):
        ids = await encode_chat(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        sp = params(body, check_prompt(ids, body.requested_max_tokens(), None), top)
        try:  # the answer's grammar: forced calls, else the structured output's
            grammar = tools.answer_grammar(body.forced_functions(), body.parallel_tool_calls, sp.grammar, chat,
                                           engine.grammars)
        except ValueError as e:
            raise BadRequest(400, str(e), "tool_choice") from e
        sp = dataclasses.replace(sp, grammar=grammar,  # a tokenizer may hold the call markers as special tokens
                                 skip_special_tokens=sp.skip_special_tokens and not body.parses_tools())
        choices = [Choice(j, ids, body.echoed(), tool_calls=tools.ToolCallStream() if body.parses_tools() else None)
                   for j in range(body.n)]
        per_choice = [dataclasses.replace(sp, seed=choice_seed(sp.seed, j)) for j in range(body.n)]
        return await run(http, choices, per_choice, body, chat_api=True, top=top)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card

    @app.post("/tokenize")
    async def tokenize(body: schemas.TokenizeRequest):
        check_model(body.model)
        if body.prompt is None and body.messages is None:
            raise BadRequest(400, "prompt: give a prompt or messages", "prompt")
        if body.prompt is not None and body.messages is not None:
            raise BadRequest(400, "messages: give a prompt or messages, not both", "messages")
        if body.messages is not None:
            ids = await encode_chat(body)
        else:
            ids = ([tok.bos_id] if body.add_special_tokens else []) + (await encode([body.prompt]))[0]
        strs = [tok.hf.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_seq_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: schemas.DetokenizeRequest):
        check_model(body.model)
        check_ids(body.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"tokenizer_class": "PreTrainedTokenizerFast", **chat.specials, "chat_template": chat.template,
                "add_bos_token": adds_bos, "model_max_length": max_seq_len, "vocab_size": tok.vocab_size}

    @app.get("/health")
    async def health():
        state = engine.health()  # status ok | recovering | failed (503), last_error, resets, slots_in_use, queue_length
        return JSONResponse(state, status_code=503 if state["status"] == "failed" else 200)

    @app.get("/metrics")
    async def metrics():
        state = engine.health()
        text = engine.metrics.render(queue_length=state["queue_length"], slots_in_use=state["slots_in_use"],
                                     first_moe_layer=engine.runner.config.num_dense_layers,
                                     cache_tokens=(state["cache_tokens_used"], state["cache_tokens_total"]))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _best(choices: list[Choice], keep: int) -> list[Choice]:
    """Per prompt (runs of equal prompt), the `keep` choices of highest cumulative logprob, renumbered."""
    out = []
    for i, (_, group) in enumerate(itertools.groupby(choices, key=lambda c: id(c.prompt))):
        best = sorted(group, key=lambda c: -c.cumulative_logprob())[:keep]
        out += [dataclasses.replace(c, index=i * keep + j) for j, c in enumerate(best)]
    return out


async def _sse(engine: Engine, name, requests: list[Request], queue: asyncio.Queue, choices: list[Choice], rid: str,
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
            yield f"data: {json.dumps(responses.body(rid, model, [out], None, chat=chat_api, chunk=True))}\n\n"
        if prompt_tokens is not None:
            use = responses.usage(prompt_tokens, sum(c.completion_tokens for c in choices))
            yield f"data: {json.dumps(responses.body(rid, model, [], use, chat=chat_api, chunk=True))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for r in requests:
            engine.cancel(r)

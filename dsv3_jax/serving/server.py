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
import time
import uuid

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from dsv3_jax.serving import collect, responses, schemas, tools
from dsv3_jax.serving.admission import Admission, BadRequest, choice_seed
from dsv3_jax.serving.chat import ChatTemplateError, ChatTokenizer
from dsv3_jax.serving.engine import Engine, EngineFailed, QueueFull, Request, SamplingParams
from dsv3_jax.serving.grammar import GrammarError
from dsv3_jax.serving.responses import Choice

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_REQUEST_BYTES = 4 * 2**20  # a body over this is refused (413): far above any context's worth of text


_ERROR_KINDS = {404: "not_found_error", 429: "rate_limit_error", 500: "internal_error"}  # else invalid_request_error


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
    api = _Api(engine, chat, model_name)
    _answer_errors(app, api.error)
    for method, path, handler in [("POST", "/v1/completions", api.completions),
                                  ("POST", "/v1/chat/completions", api.chat_completions),
                                  ("GET", "/v1/models", api.models), ("GET", "/v1/models/{model_id:path}", api.model),
                                  ("POST", "/tokenize", api.tokenize), ("POST", "/detokenize", api.detokenize),
                                  ("GET", "/tokenizer_info", api.tokenizer_info), ("GET", "/health", api.health),
                                  ("GET", "/metrics", api.metrics)]:
        app.add_api_route(path, handler, methods=[method])
    return app


def _answer_errors(app: fastapi.FastAPI, error) -> None:
    """Every failure as OpenAI's error shape: `error(status, message, param)`."""

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


class _Api:
    """The routes over one engine, its tokenizer and the model's name."""

    def __init__(self, engine: Engine, chat: ChatTokenizer, model_name: str):
        self.engine, self.chat, self.tok, self.model_name = engine, chat, chat.tokenizer, model_name
        self.context = engine.runner.context
        self.admit = Admission(model_name, self.context, engine.runner.config.vocab_size, engine.eos_ids,
                               speculates=bool(engine.runner.drafts), grammars=engine.grammars)
        self.model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "dsv3-jax",
                           "max_model_len": self.context}
        self.adds_bos = self.tok.hf.encode("a").ids[:1] == [self.tok.bos_id]  # the file's post-processor adds BOS

    def error(self, status: int, message: str, param: str | None = None) -> JSONResponse:
        self.engine.metrics.response(status)
        kind = _ERROR_KINDS.get(status, "invalid_request_error")
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)

    async def completions(self, body: schemas.CompletionRequest, http: fastapi.Request):
        prompts, best_of = body.prompts(), body.best_of or body.n
        _check_completion_counts(body, prompts, best_of)
        top = body.logprobs if best_of == body.n else (body.logprobs or 0)  # best_of ranks by logprob
        choices, per_choice = [], []
        encoded = iter(await self._encode([p for p in prompts if isinstance(p, str)]))
        for i, prompt in enumerate(prompts):
            ids = [self.tok.bos_id] + next(encoded) if isinstance(prompt, str) else list(prompt)
            sp = self.admit.sampling(body, self.admit.max_tokens(ids, body.max_tokens, DEFAULT_COMPLETION_TOKENS),
                                     top, echo=body.echo and body.logprobs is not None)
            echo_text = (prompt if isinstance(prompt, str) else self.tok.decode(ids)) if body.echo else ""
            for j in range(best_of):
                choices.append(Choice(i * best_of + j, ids, echo_text))
                per_choice.append(dataclasses.replace(sp, seed=choice_seed(sp.seed, j)))
        return await self._respond(http, choices, per_choice, body, chat_api=False, top=body.logprobs,
                                   echo=body.echo, keep=body.n if best_of > body.n else None)

    async def chat_completions(self, body: schemas.ChatRequest, http: fastapi.Request):
        ids = await self._encode_chat(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        sp = self.admit.sampling(body, self.admit.max_tokens(ids, body.requested_max_tokens(), None), top)
        try:  # the answer's grammar: forced calls, else the structured output's
            grammar = tools.answer_grammar(body.forced_functions(), body.parallel_tool_calls, sp.grammar, self.chat,
                                           self.engine.grammars)
        except ValueError as e:
            raise BadRequest(400, str(e), "tool_choice") from e
        sp = dataclasses.replace(sp, grammar=grammar,  # a tokenizer may hold the call markers as special tokens
                                 skip_special_tokens=sp.skip_special_tokens and not body.parses_tools())
        choices = [Choice(j, ids, body.echoed(), tool_calls=tools.ToolCallStream() if body.parses_tools() else None)
                   for j in range(body.n)]
        per_choice = [dataclasses.replace(sp, seed=choice_seed(sp.seed, j)) for j in range(body.n)]
        return await self._respond(http, choices, per_choice, body, chat_api=True, top=top)

    async def models(self):
        return {"object": "list", "data": [self.model_card]}

    async def model(self, model_id: str):
        self.admit.check_model(model_id)
        return self.model_card

    async def tokenize(self, body: schemas.TokenizeRequest):
        self.admit.check_model(body.model)
        if body.prompt is None and body.messages is None:
            raise BadRequest(400, "prompt: give a prompt or messages", "prompt")
        if body.prompt is not None and body.messages is not None:
            raise BadRequest(400, "messages: give a prompt or messages, not both", "messages")
        if body.messages is not None:
            ids = await self._encode_chat(body)
        else:
            ids = ([self.tok.bos_id] if body.add_special_tokens else []) + (await self._encode([body.prompt]))[0]
        strs = [self.tok.hf.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.context, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: schemas.DetokenizeRequest):
        self.admit.check_model(body.model)
        self.admit.check_ids(body.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(self.tok.decode, body.tokens)}

    async def tokenizer_info(self):
        return {"tokenizer_class": "PreTrainedTokenizerFast", **self.chat.specials, "chat_template": self.chat.template,
                "add_bos_token": self.adds_bos, "model_max_length": self.context, "vocab_size": self.tok.vocab_size}

    async def health(self):
        state = self.engine.health()  # status ok | recovering | failed (503), last_error, resets, slots, queue
        return JSONResponse(state, status_code=503 if state["status"] == "failed" else 200)

    async def metrics(self):
        state = self.engine.health()
        text = self.engine.metrics.render(queue_length=state["queue_length"], slots_in_use=state["slots_in_use"],
                                          first_moe_layer=self.engine.runner.config.num_dense_layers,
                                          cache_tokens=(state["cache_tokens_used"], state["cache_tokens_total"]))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _encode(self, texts: list[str]) -> list[list[int]]:
        """The texts' ids (no special tokens), from a worker thread."""
        return await asyncio.to_thread(self.tok.encode_batch, texts)

    async def _encode_chat(self, body: schemas.ChatRequest | schemas.TokenizeRequest) -> list[int]:
        """The rendered chat's ids: `tools` passed as HF passes them, vLLM's chat_template_kwargs over them."""
        tool_list = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        variables = {"tools": tool_list} | (body.chat_template_kwargs or {})
        try:
            text = await asyncio.to_thread(self.chat.render, [m.for_template() for m in body.messages],
                                           add_generation_prompt=body.add_generation_prompt, **variables)
        except (ChatTemplateError, ValueError) as e:
            raise BadRequest(400, str(e), "messages") from e
        return (await self._encode([text]))[0]

    def _submit(self, choices: list[Choice], per_choice: list[SamplingParams], queue: asyncio.Queue) -> list[Request]:
        """One engine request a choice, its events put on `queue`; all or none of them submitted."""
        loop, requests = asyncio.get_running_loop(), []
        try:
            for c, sp in zip(choices, per_choice):
                sink = lambda ev, c=c: loop.call_soon_threadsafe(queue.put_nowait, (c, ev))  # noqa: E731
                requests.append(self.engine.submit(Request(list(c.prompt), sp, sink)))
        except Exception:  # the queue is full, the engine failed or a grammar failed: none of them runs
            for r in requests:
                self.engine.cancel(r)
            raise
        return requests

    async def _respond(self, http, choices: list[Choice], per_choice: list[SamplingParams], req, *, chat_api: bool,
                       top: int | None, echo: bool = False, keep: int | None = None):
        """Generates every choice; answers with the first `keep` per prompt by cumulative logprob (best_of)."""
        queue = asyncio.Queue()
        try:
            requests = self._submit(choices, per_choice, queue)
        except (QueueFull, EngineFailed) as e:
            return self.error(429 if isinstance(e, QueueFull) else 503, str(e))
        rid = ("chatcmpl-" if chat_api else "cmpl-") + uuid.uuid4().hex[:24]
        prompt_tokens = sum(len(p) for p in {id(c.prompt): c.prompt for c in choices}.values())
        name = responses.namer(self.tok, req.return_tokens_as_token_ids)
        if req.stream:
            self.engine.metrics.response(200)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = collect.sse(self.engine, name, requests, queue, choices, rid, self.model_name, chat_api, top,
                                 echo, prompt_tokens if include_usage else None)
            return StreamingResponse(stream, media_type="text/event-stream")
        if not await collect.gather(self.engine, http, queue, requests, len(choices)):
            return None
        if any(c.finish_reason == "error" for c in choices):
            return self.error(500, "the engine failed on this request (see the server log)")
        use = responses.usage(prompt_tokens, sum(c.completion_tokens for c in choices))
        choices = collect.best(choices, keep) if keep is not None else choices
        if chat_api:
            out = [responses.chat_choice(name, c, top, chunk=False) for c in choices]
        else:
            out = [responses.completion_choice(name, c, top, echo_prompt=echo) for c in choices]
        payload = responses.body(rid, self.model_name, out, use, chat=chat_api, chunk=False)
        if req.prompt_logprobs is not None:  # vLLM's places: beside the chat choices, in each completions choice
            scored = [responses.prompt_logprobs(self.tok, c.prompt, c.prompt_logprobs, req.prompt_logprobs)
                      for c in choices]
            for o, p in zip([payload] if chat_api else out, scored):
                o["prompt_logprobs"] = p
        self.engine.metrics.response(200)
        return JSONResponse(payload)


def _check_completion_counts(body: schemas.CompletionRequest, prompts: list, best_of: int) -> None:
    if not prompts:
        raise BadRequest(400, "prompt: give at least one prompt", "prompt")
    if body.max_tokens == 0 and not body.echo:
        raise BadRequest(400, "max_tokens=0 generates nothing: it is only allowed with echo", "max_tokens")
    if best_of < body.n:
        raise BadRequest(400, f"best_of ({best_of}) must be >= n ({body.n})", "best_of")
    if best_of > body.n and body.stream:
        raise BadRequest(400, "best_of > n cannot be streamed (the best are known only at the end)", "best_of")

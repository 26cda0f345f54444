"""The OpenAI-compatible HTTP layer (FastAPI) over an `Engine`.

GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`stream=true`: server-sent events,
`data: {chunk}` ... `data: [DONE]`), GET /health, GET /metrics (Prometheus text).

Errors are OpenAI-shaped `{"error": {"message", "type", "param"}}`: 400 for malformed JSON, bad
values (the field named), a prompt that does not fit the context, unsupported options; 404 for an
unknown model; 429 when the queue is full. A client that disconnects (streaming or not) cancels
its request, which frees its slot at once.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dsv3_jax.serving import schemas
from dsv3_jax.serving.chat import ChatTemplateError, ChatTokenizer
from dsv3_jax.serving.engine import Engine, EngineFailed, Event, QueueFull, Request, SamplingParams

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def make_app(engine: Engine, chat: ChatTokenizer, model_name: str) -> fastapi.FastAPI:
    app = fastapi.FastAPI(title="dsv3-jax", docs_url=None, redoc_url=None)
    tok, max_seq_len, vocab = chat.tokenizer, engine.runner.context, engine.runner.config.vocab_size

    def error(status: int, message: str, param: str | None = None) -> JSONResponse:
        engine.metrics.response(status)
        return JSONResponse(schemas.error_body(message, param=param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return error(400, f"malformed JSON body: {first.get('msg')}")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"{where}: {first.get('msg')}", param=where or None)

    @app.exception_handler(BadRequest)
    async def _bad(_, exc: BadRequest):
        return error(exc.status, exc.message, exc.param)

    def check_prompt(ids: list[int], max_tokens: int | None, default: int | None) -> int:
        if not ids:
            raise BadRequest(400, "the prompt is empty (it must encode to at least one token)", "prompt")
        if any(not 0 <= i < vocab for i in ids):
            raise BadRequest(400, f"prompt token ids must lie in [0, vocab_size={vocab})", "prompt")
        room = max_seq_len - len(ids)
        if room < 1:
            raise BadRequest(400, f"the prompt has {len(ids)} tokens; the context holds {max_seq_len} "
                                  "(prompt + max_tokens) and leaves no room to generate", "prompt")
        max_tokens = max_tokens if max_tokens is not None else min(default or room, room)
        if len(ids) + max_tokens > max_seq_len:
            raise BadRequest(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                  f"length {max_seq_len}; lower max_tokens or shorten the prompt", "max_tokens")
        return max_tokens

    def params(req: schemas._Sampling, max_tokens: int) -> SamplingParams:
        if req.model != model_name:
            raise BadRequest(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}", "model")
        bad = req.unsupported()
        if bad:
            raise BadRequest(400, f"unsupported option(s): {', '.join(bad)}", bad[0].split()[0])
        stop_ids = tuple(req.stop_token_ids or ())
        if any(not 0 <= i < vocab for i in stop_ids):
            raise BadRequest(400, f"stop_token_ids must lie in [0, vocab_size={vocab})", "stop_token_ids")
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed if req.seed is not None else uuid.uuid4().int % 2**32,
                              stop=tuple(req.stop_strings()), stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
                              prefix_cache=req.prefix_cache)

    async def run(http: fastapi.Request, prompt: list[int], sp: SamplingParams, req, *, chat_api: bool):
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        request = Request(prompt, sp, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        try:
            engine.submit(request)
        except QueueFull as e:
            return error(429, str(e))
        except EngineFailed as e:
            return error(503, str(e))
        rid = ("chatcmpl-" if chat_api else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            engine.metrics.response(200)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(engine, request, queue, rid, model_name, chat_api, include_usage),
                                     media_type="text/event-stream")
        text, last = [], None
        try:
            while last is None or last.finish_reason is None:
                try:
                    last = await asyncio.wait_for(queue.get(), timeout=0.5)
                    text.append(last.text)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return None
        finally:
            engine.cancel(request)  # no-op once finished; frees the slot if the client went away
        if last.finish_reason == "error":
            return error(500, "the engine failed on this request (see the server log)", None)
        use = schemas.usage(last.prompt_tokens, last.completion_tokens)
        build = schemas.chat_body if chat_api else schemas.completion_body
        engine.metrics.response(200)
        return JSONResponse(build(rid, model_name, "".join(text), last.finish_reason, use, chunk=False))

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, http: fastapi.Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise BadRequest(400, f"one prompt per request (got {len(prompt)})", "prompt")
            prompt = prompt[0]
        ids = [tok.bos_id] + tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        sp = params(body, check_prompt(ids, body.max_tokens, DEFAULT_COMPLETION_TOKENS))
        return await run(http, ids, sp, body, chat_api=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatRequest, http: fastapi.Request):
        try:
            messages = [m.model_dump(exclude_none=True) | {"content": m.text()} for m in body.messages]
            ids = chat.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
        except (ChatTemplateError, ValueError) as e:
            raise BadRequest(400, str(e), "messages") from e
        sp = params(body, check_prompt(ids, body.requested_max_tokens(), None))
        return await run(http, ids, sp, body, chat_api=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dsv3-jax",
                                            "max_model_len": max_seq_len}]}

    @app.get("/health")
    async def health():
        state = engine.health()  # status ok | recovering | failed (503), last_error, resets
        body = state | {"slots_in_use": engine.slots_in_use(), "queue_length": engine.queue_length()}
        return JSONResponse(body, status_code=503 if state["status"] == "failed" else 200)

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics.render(queue_length=engine.queue_length(), slots_in_use=engine.slots_in_use(),
                                     first_moe_layer=engine.runner.config.num_dense_layers)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


async def _sse(engine: Engine, request: Request, queue: asyncio.Queue, rid: str, model: str, chat_api: bool,
               include_usage: bool):
    """Server-sent events of one request; cancels it when the client goes away (the generator is closed)."""
    build = schemas.chat_body if chat_api else schemas.completion_body
    first = True
    try:
        while True:
            ev: Event = await queue.get()
            if ev.text or ev.finish_reason is not None or first:
                extra = {"first": first} if chat_api else {}
                yield f"data: {json.dumps(build(rid, model, ev.text, ev.finish_reason, None, chunk=True, **extra))}\n\n"
                first = False
            if ev.finish_reason is not None:
                break
        if include_usage:
            use = schemas.usage(ev.prompt_tokens, ev.completion_tokens)
            yield f"data: {json.dumps(schemas.usage_chunk(rid, model, use, chat=chat_api))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        engine.cancel(request)

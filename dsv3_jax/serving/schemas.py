"""OpenAI-compatible request bodies (validated) and response bodies.

Requests follow the OpenAI API (`/v1/completions`, `/v1/chat/completions`) with vLLM's extensions
`top_k`, `stop_token_ids`, `ignore_eos`. Fields the engine does not implement are refused with a 400
naming them rather than silently ignored: n > 1, best_of > 1, echo, logprobs, penalties, logit_bias,
tools. Values out of range are refused by pydantic (the server turns that into a 400 naming the field).
"""

from __future__ import annotations

import time
from typing import Literal

import pydantic
from pydantic import BaseModel, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")  # unknown fields are checked by `unsupported`

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, lt=2**31)  # 0 (or -1, as vLLM spells it) = off
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    prefix_cache: bool = True  # False: this request neither reuses nor stores cached prompt-prefix rows
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None

    @pydantic.field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, v):
        return 0 if v == -1 else v

    def unsupported(self) -> list[str]:
        """Names of fields set to values this server does not implement."""
        out = [] if self.n == 1 else ["n (only 1)"]
        out += [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name)]
        out += ["logit_bias"] if self.logit_bias else []
        return out + self._unsupported_extra()

    def _unsupported_extra(self) -> list[str]:
        known_off = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (False,), "best_of": (None, 1),
                     "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
                     "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
                     "max_completion_tokens": None, "metadata": None, "store": None, "service_tier": None}
        extra = self.model_extra or {}
        return [k for k, v in extra.items() if k not in known_off or (known_off[k] is not None and v not in known_off[k])]

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """Content as text; list content keeps its text parts (no images here)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages: content part of type {part.get('type')!r} is not supported (text only)")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        extra = (self.model_extra or {}).get("max_completion_tokens")
        return self.max_tokens if self.max_tokens is not None else extra


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict | None, *, chunk: bool) -> dict:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    if use is not None:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict | None, *, chunk: bool,
              first: bool = False) -> dict:
    if chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
    body = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


def usage_chunk(rid: str, model: str, use: dict, *, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": use}


def error_body(message: str, *, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}

"""OpenAI-compatible request bodies, validated field by field (a bad value is a 400 naming the field).

Parsing is strict: an integer field takes integers only (not `true` or `5.0`), a float field finite numbers
only (not NaN or Infinity, which Python's JSON reader lets through), and every string must be valid Unicode
(a lone surrogate, which a JSON `\\ud800` escape or raw CESU-8 bytes carry, is refused, naming where it sits).
Requests follow the OpenAI API (`/v1/completions`, `/v1/chat/completions`, chat with `tools`) with vLLM's
extensions `top_k`, `stop_token_ids`, `ignore_eos`, `repetition_penalty`, `min_tokens`, `prompt_logprobs`,
`include_stop_str_in_output`, `skip_special_tokens`, chat `echo`, the structured-output fields `guided_json`,
`guided_regex`, `guided_choice` (and OpenAI's `response_format`; `grammar` makes the grammar), and vLLM's
`/tokenize`, `/detokenize` bodies. Unknown fields, and known ones set to values this server does not
implement (tools in completions, `suffix`), are refused with a 400 naming them rather than silently
ignored. Response bodies are built in `responses`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, Field

from dsv3_jax.data.chat_template import RENDERER_VARIABLES
from dsv3_jax.inference.sampling import MAX_LOGPROBS
from dsv3_jax.serving.penalties import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

MAX_N = 16  # choices (n, best_of) one request may ask for: each takes a decode slot
KeyId = Annotated[int, pydantic.Strict(False)]  # a token id as a JSON object's key: a string of digits
_SURROGATE = re.compile("[\ud800-\udfff]")


def _own_variables(kwargs: dict | None) -> dict | None:
    taken = sorted(set(kwargs or {}) & set(RENDERER_VARIABLES))
    if taken:
        raise ValueError(f"{taken} are set by the chat template's renderer, not by the request")
    return kwargs


# More chat template variables (vLLM's chat_template_kwargs), e.g. {"thinking": true} for DeepSeek-V3.1.
TemplateKwargs = Annotated[dict[str, Any] | None, pydantic.AfterValidator(_own_variables)]


def lone_surrogate(v, where: str) -> str | None:
    """`where` extended to the first string in `v` (nested in lists and dicts) that holds a lone surrogate, or None."""
    if isinstance(v, str):
        return where if not v.isascii() and _SURROGATE.search(v) else None
    if isinstance(v, list) and v and isinstance(v[0], int):
        return None  # token ids (the schema refuses a list that mixes in text)
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    return next((w for k, x in items if (w := lone_surrogate(x, f"{where}.{k}"))), None)


class _Strict(BaseModel):
    model_config = pydantic.ConfigDict(strict=True, allow_inf_nan=False)


class _Request(_Strict):
    """A request body: strict fields, no unknown ones, and valid Unicode in every string."""

    model_config = pydantic.ConfigDict(extra="forbid")

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _valid_text(cls, v, info: pydantic.ValidationInfo):
        if where := lone_surrogate(v, info.field_name):
            raise ValueError(f"the text at {where} holds a lone surrogate: it is not valid Unicode (send UTF-8 text)")
        return v


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Request):
    model_config = pydantic.ConfigDict(extra="allow")  # unknown fields are checked by `unsupported`

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, lt=2**31)  # 0 (or -1, as vLLM spells it) = off
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    prefix_cache: bool = True  # False: this request neither reuses nor shares cached prompt-prefix pages
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # vLLM's: > 1 discourages tokens already seen
    logit_bias: dict[KeyId, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int = Field(0, ge=0)  # EOS and stop_token_ids banned until this many tokens
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens `token_id:N`, not by text
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: every prompt token's + this many
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop token's text) ends the text
    skip_special_tokens: bool = True  # vLLM's: special tokens are left out of the text
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    guided_json: dict | str | None = None  # vLLM's: a JSON schema the output follows
    guided_regex: str | None = None  # vLLM's: a regular expression the output matches
    guided_choice: list[str] | None = None  # vLLM's: the output is one of these texts
    user: str | None = None

    @pydantic.field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, v):
        return 0 if v == -1 else v

    def unsupported(self) -> list[str]:
        """Names of fields set to values this server does not implement."""
        known_off = {"suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
                     "parallel_tool_calls": (None,),
                     "metadata": None, "store": None, "service_tier": None}
        extra = self.model_extra or {}
        return [k for k, v in extra.items()
                if k not in known_off or (known_off[k] is not None and v not in known_off[k])]

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    # left to right: an id list is matched by list[int] at once (smart mode would try every member on every id)
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (the prompt scored, nothing generated)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's log-prob + this many alternatives
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @pydantic.field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, v, handler):
        try:
            return handler(v)
        except pydantic.ValidationError as e:
            if e.errors()[0]["type"] == "value_error":  # the text check of `_Request`: already names the place
                raise
            raise ValueError("must be a text, a list of texts, a list of token ids (ints) or a list of such "
                             "lists") from None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str | dict  # a JSON text (OpenAI's), or the object itself (HF templates take either)


class ToolCall(_Strict):
    """A call of an earlier assistant turn, as a client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    model_config = pydantic.ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call answered

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

    def for_template(self) -> dict:
        """The message as the chat template sees it; `developer` is OpenAI's newer name for `system`. The content
        of a turn of calls alone stays None, as OpenAI sends it: DeepSeek-V3's templates tell such a turn by it
        (transformers 5 drops the key, and those templates then fail); any other content is text."""
        role = "system" if self.role == "developer" else self.role
        content = None if self.content is None and self.tool_calls else self.text()
        return self.model_dump(exclude_none=True) | {"role": role, "content": content}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's: the answer starts with the last message's content when it has the answer's role
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def parses_tools(self) -> bool:
        """Whether the answer is read for tool calls (tools given and tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_functions(self) -> dict[str, dict | None] | None:
        """name -> parameters of the functions the answer must call (required, or the named one), or None.
        Raises ValueError when tool_choice asks for calls without tools, or names no given function."""
        if self.tool_choice in (None, "none", "auto"):
            return None
        functions = {t.function.name: t.function.parameters for t in self.tools or []}
        if not functions:
            raise ValueError("tool_choice: calls are asked for but no tools are given")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in functions:
                raise ValueError(f"tool_choice: the function {name!r} is not among the tools ({', '.join(functions)})")
            return {name: functions[name]}
        return functions

    def echoed(self) -> str:
        """vLLM's chat echo: the last message's text when the answer continues its role, else ""."""
        last = self.messages[-1]
        continued = "assistant" if self.add_generation_prompt else last.role
        return last.text() if self.echo and last.role == continued else ""


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a text prompt (BOS added when add_special_tokens), or chat messages (templated)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    return_token_strs: bool = False
    tools: list[Tool] | None = None  # rendered with the messages, as chat renders them


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]

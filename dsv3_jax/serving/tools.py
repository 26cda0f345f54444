"""OpenAI tool calls in DeepSeek-V3's format: the grammar that forces calls, and the parser that reads
them out of generated text, whole or as it streams.

DeepSeek-V3's chat template writes an assistant's calls, and the tool results that answer them, as

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    \\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>RESULT<｜tool▁output▁end｜>\\n...<｜tool▁outputs▁end｜>

In DeepSeek-V3's tokenizer every marker is one token; the bundled tokenizer has none of them, so its
template (`BUNDLED_TEMPLATE`) writes them as plain text. The parser reads decoded text (a request with
tools keeps special tokens in it); the grammar names a marker by its token id where the tokenizer has it
as a special token (a grammar matches the text of ordinary tokens only), by its text otherwise.

`tool_choice`: "none" renders the tools and leaves the output as text; "auto" (the default with tools)
parses calls out of it; "required" and a named function force it through a grammar: what the template
writes before an assistant's calls (its lead-in, " " in the bundled template), then one or more calls
(one with `parallel_tool_calls: false`; only the named function's for a named choice) whose arguments
match the function's `parameters` JSON schema (strict: `grammar.strict`), written as the template's `tojson`
writes them.
"""

from __future__ import annotations

import json
import re
import uuid

import llguidance

from dsv3_jax.serving.grammar import strict
from dsv3_jax.serving.textstream import held

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
ARGS_BEGIN, ARGS_END = "\n```json\n", "\n```" + CALL_END
_HEADER = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(SEP) + "(.*?)" + re.escape(ARGS_BEGIN), re.DOTALL)
_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # tojson's


def lead_in(chat) -> str:
    """What `chat`'s template writes between the generation prompt and an assistant's first call marker.
    Raises ValueError when it does not write tool calls in DeepSeek-V3's format."""
    user = {"role": "user", "content": "Hi"}
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    prompt = chat.render([user], add_generation_prompt=True)
    turn = chat.render([user, {"role": "assistant", "content": None, "tool_calls": [call]}],
                       add_generation_prompt=False)
    end = turn.find(CALLS_BEGIN, len(prompt))
    if not turn.startswith(prompt) or end < 0:
        raise ValueError(f"the chat template of {chat.template_origin} does not write tool calls in DeepSeek-V3's "
                         f"format ({CALLS_BEGIN}...), so tool_choice 'required' or a named function cannot be "
                         "enforced; use tool_choice 'auto'")
    return turn[len(prompt):end]


def _literal(text: str, tokenizer) -> str:
    """A grammar terminal for `text`: the special token it is (`<[id]>`), else its characters."""
    token = tokenizer.hf.token_to_id(text)
    added = tokenizer.hf.get_added_tokens_decoder().get(token) if token is not None else None
    return f"<[{token}]>" if added is not None and added.special else json.dumps(text, ensure_ascii=False)


def grammar(functions: dict[str, dict | None], lead: str, parallel: bool, tokenizer) -> str:
    """The llguidance grammar of an answer made of calls to `functions` (name -> parameters schema).
    Raises ValueError naming the function whose schema the grammar library refuses."""
    lit = lambda text: _literal(text, tokenizer)  # noqa: E731
    calls = "call (" + json.dumps("\n") + " call)*" if parallel else "call"
    rules = [f"start: {json.dumps(lead)} {lit(CALLS_BEGIN)} {calls} {lit(CALLS_END)}" if lead else
             f"start: {lit(CALLS_BEGIN)} {calls} {lit(CALLS_END)}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, (name, schema) in enumerate(functions.items()):
        args = json.dumps({"x-guidance": _SEPARATORS, **strict(schema or {"type": "object"})}, ensure_ascii=False)
        rule = f"args_{i}: %json {args}"
        alone = llguidance.LLMatcher.grammar_from_lark(f"start: args_{i}\n{rule}")
        error = llguidance.LLMatcher.validate_grammar(alone)
        if error:
            raise ValueError(f"the parameters schema of function {name!r} cannot be compiled to a grammar: {error}")
        rules += [f"call_{i}: {lit(CALL_BEGIN)} \"function\" {lit(SEP)} {json.dumps(name + ARGS_BEGIN)} args_{i} "
                  f"{json.dumps(ARGS_END.removesuffix(CALL_END))} {lit(CALL_END)}", rule]
    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))


def answer_grammar(functions: dict[str, dict | None] | None, parallel: bool, structured: str | None, chat,
                   grammars) -> str | None:
    """The grammar of an answer that must call `functions` (name -> parameters), compiled and kept by the
    engine's `grammars`; without forced calls, `structured` (a structured output's grammar, or None).
    Raises ValueError when both are asked for, or when the calls cannot be forced."""
    if functions is None:
        return structured
    if structured is not None:
        raise ValueError("tool_choice: forced calls and a structured output (response_format, guided_*) cannot "
                         "both shape one answer; give one of them")
    forced = grammar(functions, lead_in(chat), parallel, chat.tokenizer)
    grammars.check(forced, "tool_choice")
    return forced


class ToolCallStream:
    """Generated text -> (content delta, OpenAI tool-call deltas), as the text arrives.

    Content is the text before the calls begin, without the blanks that end it. A call's first delta
    carries its index, id, type and name once its header is complete; its arguments follow as they are
    generated. Text after the calls is dropped. Pushing the whole text at once gives the same deltas in
    fewer pieces, so a whole answer and a stream agree.
    """

    def __init__(self):
        self.buf, self.held, self.in_calls, self.in_args, self.calls = "", "", False, False, 0

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """Adds generated text (`final`: the last of it); -> (content delta, tool-call deltas)."""
        self.buf += text
        content, deltas, passed = "", [], True
        while passed:
            if not self.in_calls:
                piece, passed = self._until(CALLS_BEGIN, final)
                content, self.in_calls = content + piece, passed
            elif not self.in_args:
                passed = self.in_args = self._header(deltas)
            else:
                piece, passed = self._until(ARGS_END, final)
                if piece:
                    deltas.append({"index": self.calls - 1, "function": {"arguments": piece}})
                self.in_args = not passed
        return self._content(content, final), deltas

    def _until(self, marker: str, final: bool) -> tuple[str, bool]:
        """Takes the text before `marker` (keeping back what may still become it); True if past the marker."""
        at = self.buf.find(marker)
        if at >= 0:
            piece, self.buf = self.buf[:at], self.buf[at + len(marker):]
            return piece, True
        cut = len(self.buf) - (0 if final else held(self.buf, [marker]))
        piece, self.buf = self.buf[:cut], self.buf[cut:]
        return piece, False

    def _header(self, deltas: list[dict]) -> bool:
        """Takes a complete call header (a new call's first delta); False while there is none yet."""
        header = _HEADER.match(self.buf.lstrip("\n"))
        if header is None:
            return False
        deltas.append({"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": header[2], "arguments": ""}})
        self.buf, self.calls = self.buf.lstrip("\n")[header.end():], self.calls + 1
        return True

    def _content(self, text: str, final: bool) -> str:
        """`text` up to its last non-blank character; trailing blanks wait for more (an answer that is only
        calls has no content). At the end without a call the rest is content, an unreadable call included."""
        self.held += text
        if final and not self.calls:
            text, self.held = self.held + (CALLS_BEGIN + self.buf if self.in_calls else ""), ""
            return text
        end = len(self.held.rstrip())
        text, self.held = self.held[:end], self.held[end:]
        return text


def merged(deltas: list[dict]) -> list[dict]:
    """Whole tool calls from their deltas (the arguments of each call concatenated)."""
    calls = []
    for d in deltas:
        if "id" in d:
            calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls

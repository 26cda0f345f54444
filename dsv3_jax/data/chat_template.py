"""Chat templates: conversations -> text, rendered as HF transformers renders them, with the character
spans of the assistant turns.

Template: `chat_template` of the `tokenizer_config.json` beside the tokenizer file (a string, or
HF's list of {name, template}, of which "default" is used), or one given explicitly (a file, e.g.
`config.data.chat_template`). Rendering copies HF's `apply_chat_template`: a sandboxed immutable
jinja2 environment with trim_blocks and lstrip_blocks, loop controls, `tojson` that keeps
non-ASCII text, `raise_exception`, `strftime_now`, and the special tokens (`bos_token`,
`eos_token`, `pad_token`) as variables. The text is then encoded without adding special tokens
(the template writes them).

Assistant spans: HF's `{% generation %}...{% endgeneration %}` block marks the text a model is
trained to produce. `render_with_spans` records the character span of every such block, exactly
as HF's `return_assistant_tokens_mask` does (the text rendered before the block gives its start),
so a loss mask is built per message from the template itself, never by diffing prompt prefixes.

The bundled tokenizer has no template file; it uses `BUNDLED_TEMPLATE` (docs/serving.md):

    <|bos|>System: {system}\n\nUser: {user}\n\nAssistant: {assistant}<|eos|>\n\nUser: ...\n\nAssistant:

with `Developer:` for the developer role (the blank line after an assistant turn is written as an
expression, which jinja's trim_blocks leaves alone). Its generation block holds " {assistant}<|eos|>": the
space the generation prompt `Assistant:` leaves to the model, the answer, and the EOS that ends it.

Tools use DeepSeek-V3's tool-call format (`dsv3_jax/serving/tools.py`), its markers written as text (the
bundled tokenizer has no tokens for them): `tools` (HF's argument) are listed first, one function's JSON a
line, after `Tools:`; an assistant turn's `tool_calls` follow its content inside the generation block, and
a run of `tool` messages is one `<｜tool▁outputs▁begin｜>...<｜tool▁outputs▁end｜>` block of its own:

    Tools:\n{function}\n\nUser: ...\n\nAssistant: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json\nARGS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><|eos|>\n\n<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>
    RESULT<｜tool▁output▁end｜><｜tool▁outputs▁end｜>\n\nAssistant:
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
import threading

import jinja2
import jinja2.ext
import jinja2.sandbox

from dsv3_jax.data.tokenizer import BUNDLED_PATH, load_tokenizer, read_tokenizer_config

BUNDLED_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}Tools:{% for tool in tools %}{{ '\n' }}{{ tool['function'] | default(tool) | tojson }}{% endfor %}"
    "{{ '\n\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}System: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'developer' %}Developer: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}"
    "Assistant:{% generation %} {{ message['content'] or '' }}"
    "{% if message['tool_calls'] %}<｜tool▁calls▁begin｜>{% for call in message['tool_calls'] %}"
    "{% set args = call['function']['arguments'] %}{{ '' if loop.first else '\n' }}"
    "<｜tool▁call▁begin｜>{{ call['type'] | default('function') }}<｜tool▁sep｜>{{ call['function']['name'] }}"
    "{{ '\n```json\n' }}{{ args if args is string else args | tojson }}{{ '\n```' }}<｜tool▁call▁end｜>"
    "{% endfor %}<｜tool▁calls▁end｜>{% endif %}"
    "{{ eos_token }}{% endgeneration %}{{ '\n\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<｜tool▁outputs▁begin｜>{% else %}{{ '\n' }}{% endif %}"
    "<｜tool▁output▁begin｜>{{ message['content'] }}<｜tool▁output▁end｜>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<｜tool▁outputs▁end｜>{{ '\n\n' }}{% endif %}"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")

# The variables the renderer itself sets; a caller's extra variables may not reuse them.
RENDERER_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token")

# One user and one assistant turn: a template that marks assistant text marks this one.
PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})


class ChatTemplateError(ValueError):
    """A message list the template refuses (its `raise_exception`), no template, or a template
    that cannot mark assistant turns where a loss mask needs them."""


_TRACK = threading.local()  # per render: the blocks rendered so far and the generation spans


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}` block: rendered as its body; while a render tracks spans, the body's
    [start, end) character offsets in the output are recorded (HF's AssistantTracker)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        text = caller()
        spans = getattr(_TRACK, "spans", None)
        if spans is not None:
            start = sum(len(b) for b in _TRACK.blocks)
            spans.append((start, start + len(text)))
        return text


def _raise(message):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def read_config_template(config_path: pathlib.Path) -> str | None:
    """`chat_template` of an HF `tokenizer_config.json`, or None."""
    template = read_tokenizer_config(config_path).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template if isinstance(template, str) else None


class ChatTokenizer:
    """A Tokenizer plus the chat template that goes with it.

    Args:
      path: the tokenizer file (or an HF folder holding one).
      template_file: a file holding the template text, used instead of the tokenizer's own.

    Attributes:
      template: the jinja source, or None when the tokenizer has none.
      template_origin: where it came from, for error messages.
    """

    def __init__(self, path, template_file=None):
        self.tokenizer = load_tokenizer(path)
        self.path = pathlib.Path(self.tokenizer.path)
        config = self.path.parent / "tokenizer_config.json"
        if template_file is not None:
            try:
                self.template = pathlib.Path(template_file).read_text(encoding="utf-8")
            except OSError as e:
                raise ChatTemplateError(f"cannot read the chat template {template_file}: {e}") from e
            self.template_origin = str(template_file)
        else:
            self.template, self.template_origin = read_config_template(config), str(config)
            # A copy of the bundled tokenizer (a run exported before its config was written) is the bundled one.
            if self.template is None and self.path.read_bytes() == BUNDLED_PATH.read_bytes():
                self.template, self.template_origin = BUNDLED_TEMPLATE, "the bundled template (BUNDLED_TEMPLATE)"
        tok = self.tokenizer
        self.specials = {f"{k}_token": tok.hf.id_to_token(getattr(tok, f"{k}_id")) or "" for k in ("bos", "eos", "pad")}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        return self.render_with_spans(messages, add_generation_prompt, **extra)[0]

    def render_with_spans(self, messages: list[dict], add_generation_prompt: bool = False, **extra
                          ) -> tuple[str, list[tuple[int, int]]]:
        """(text, [start, end) character spans of its `{% generation %}` blocks, in order). `extra`:
        more template variables, as HF's `apply_chat_template(**kwargs)` and the server's
        `chat_template_kwargs` pass them (DeepSeek-V3.1's `thinking`)."""
        self._need_template(": use /v1/completions")
        taken = sorted(set(extra) & set(RENDERER_VARIABLES))
        if taken:
            raise ChatTemplateError(f"chat template variable(s) {taken} are set by the renderer, not by the caller")
        _TRACK.blocks, _TRACK.spans = [], []
        try:
            for block in compile_template(self.template).generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, **self.specials, **extra):
                _TRACK.blocks.append(block)
            return "".join(_TRACK.blocks), _TRACK.spans
        except jinja2.TemplateError as e:  # not the template's own raise_exception: a ChatTemplateError already
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e
        finally:
            _TRACK.blocks, _TRACK.spans = None, None

    def _need_template(self, what_to_do: str) -> None:
        if self.template is None:
            raise ChatTemplateError(f"the tokenizer {self.path} has no chat template (no chat_template in "
                                    f"tokenizer_config.json beside it){what_to_do}")

    def encode_chat(self, messages: list[dict], **extra) -> list[int]:
        return self.tokenizer.encode(self.render(messages, **extra))

    def check_marks_assistant(self) -> None:
        """Raises ChatTemplateError naming the template when it marks no assistant text."""
        self._need_template("; give one with config.data.chat_template")
        if not self.render_with_spans(list(PROBE))[1]:
            raise ChatTemplateError(
                f"the chat template of {self.template_origin} marks no assistant text, so the loss mask of the "
                "assistant turns cannot be built: wrap each assistant message (its content and end token) in "
                "{% generation %}...{% endgeneration %}, as HF's return_assistant_tokens_mask requires")

"""Tokenizer and chat template for the server.

Tokenizer: the checkpoint folder's `tokenizer.json` when it has one, else `--tokenizer`, else the
bundled BPE (`dsv3_jax/data/assets/tokenizer.json`).

Chat template: `chat_template` of the `tokenizer_config.json` beside that tokenizer file (a string,
or HF's list of {name, template}, of which "default" is used), rendered as HF transformers renders
it: a sandboxed immutable jinja2 environment with trim_blocks and lstrip_blocks, loop controls,
`tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`, and the special tokens
(`bos_token`, `eos_token`, ...) as variables. The text is then encoded without adding special
tokens (the template writes them). The bundled tokenizer has no template file; it uses
`BUNDLED_TEMPLATE`, documented in docs/serving.md:

    <|bos|>System: {system}\n\nUser: {user}\n\nAssistant: {assistant}<|eos|>\n\nUser: ...\n\nAssistant:

A generation stops at the tokenizer's EOS, which ends every assistant turn.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib

import jinja2
import jinja2.ext
import jinja2.sandbox

from dsv3_jax.data.tokenizer import BUNDLED_PATH, Tokenizer, load_tokenizer

BUNDLED_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}System: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}{{ eos_token }}\n\n"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


class ChatTemplateError(ValueError):
    """A message list the template refuses (its `raise_exception`), or no template at all."""


def tokenizer_file(checkpoint: str | None, tokenizer: str | None) -> pathlib.Path:
    """The tokenizer.json to serve with, by the rule of the module docstring."""
    if checkpoint is not None and (pathlib.Path(checkpoint) / "tokenizer.json").is_file():
        return pathlib.Path(checkpoint) / "tokenizer.json"
    if tokenizer is not None:
        path = pathlib.Path(tokenizer)
        return path / "tokenizer.json" if path.is_dir() else path
    return BUNDLED_PATH


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}` block (marks assistant text for masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


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


def _read_template(config_path: pathlib.Path) -> str | None:
    if not config_path.is_file():
        return None
    template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template if isinstance(template, str) else None


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.hf.id_to_token(token_id) or ""


class ChatTokenizer:
    """A Tokenizer plus the chat template that goes with it."""

    def __init__(self, path: pathlib.Path):
        self.tokenizer = load_tokenizer(path)
        self.path = pathlib.Path(self.tokenizer.path)
        template = _read_template(self.path.parent / "tokenizer_config.json")
        # A copy of the bundled tokenizer (a training run exported with --to-hf) is the bundled one.
        if template is None and self.path.read_bytes() == pathlib.Path(BUNDLED_PATH).read_bytes():
            template = BUNDLED_TEMPLATE
        self.template = template
        self.specials = {"bos_token": _token_text(self.tokenizer, self.tokenizer.bos_id),
                         "eos_token": _token_text(self.tokenizer, self.tokenizer.eos_id),
                         "pad_token": _token_text(self.tokenizer, self.tokenizer.pad_id)}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if self.template is None:
            raise ChatTemplateError(f"the tokenizer {self.path} has no chat template (no chat_template in "
                                    "tokenizer_config.json beside it): use /v1/completions")
        try:
            return compile_template(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                          **self.specials, **extra)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e

    def encode_chat(self, messages: list[dict], **extra) -> list[int]:
        return self.tokenizer.encode(self.render(messages, **extra))

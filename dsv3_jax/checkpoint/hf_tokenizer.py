"""The tokenizer and generation files of an HF folder: written by the export, read by generate,
serve and convert.

Written by `write_tokenizer_files` (the `--to-hf` export), from a tokenizer.json and its chat template:
  tokenizer.json            the tokenizer, with a post-processor that prepends BOS if it had none: HF's
                            default tokenization (`add_special_tokens=True`) then gives the ids that
                            generate and serve feed the model, BOS + text, as DeepSeek-V3's does
  tokenizer_config.json     bos/eos/pad tokens, `add_bos_token`, the chat template, model_max_length
                            (over the source folder's own tokenizer_config.json when there is one)
  special_tokens_map.json   bos/eos/pad tokens
  generation_config.json    bos/eos/pad ids, over the sampling defaults an HF source carried
and the same ids go into config.json (`bos_token_id`, `eos_token_id`, `pad_token_id`), so that
transformers' `AutoTokenizer` knows its special tokens and `generate` stops at EOS.

Read by `read_generation_config`: a folder's generation_config.json (or, in our converted
checkpoint, the copy `convert` kept of the source's) as `GenerationDefaults`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil

from tokenizers import processors

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens")


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """What a generation_config.json says; None where it says nothing.

    Attributes:
      eos_ids: token ids that end a generation (HF allows one id or a list).
      temperature: 0 when the file asks for greedy decoding (`do_sample: false`).
      top_k, top_p, max_new_tokens: sampling defaults.
    """

    eos_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None


def read_generation_config(folder) -> GenerationDefaults:
    """Defaults of `folder`'s generation_config.json, or of the source an Orbax checkpoint was
    converted from; empty defaults when there is neither."""
    from dsv3_jax.checkpoint import orbax_layout

    folder = os.fspath(folder)
    path = os.path.join(folder, GENERATION_CONFIG)
    if os.path.isfile(path):
        try:
            raw = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from e
    elif orbax_layout.is_orbax_checkpoint(folder):
        raw = orbax_layout.read_meta(folder).get("source", {}).get("generation_config") or {}
    else:
        raw = {}
    return parse_generation_config(raw, path)


def parse_generation_config(raw: dict, where: str = GENERATION_CONFIG) -> GenerationDefaults:
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    if not all(isinstance(i, int) and i >= 0 for i in eos_ids):
        raise ValueError(f"{where}: eos_token_id={eos!r} must be a token id or a list of them")
    temperature = raw.get("temperature")
    if raw.get("do_sample") is False:
        temperature = 0.0
    elif raw.get("do_sample") and temperature is None:
        temperature = 1.0  # HF's default once sampling is on
    return GenerationDefaults(eos_ids, temperature, raw.get("top_k"), raw.get("top_p"), raw.get("max_new_tokens"))


def source_generation_config(hf_dir) -> dict | None:
    """The sampling defaults and eos ids of an HF folder's generation_config.json, kept by `convert`
    in our checkpoint's metadata so that `--to-hf` writes them back; None when it has none."""
    path = os.path.join(os.fspath(hf_dir), GENERATION_CONFIG)
    if not os.path.isfile(path):
        return None
    raw = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    parse_generation_config(raw, path)  # a bad file fails at conversion, naming it
    return {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", *_SAMPLING_KEYS) if k in raw}


def copy_tokenizer_files(hf_dir, out) -> None:
    """Copies an HF folder's tokenizer files (those it has) into `out`, our converted checkpoint."""
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy(os.path.join(hf_dir, name), os.path.join(out, name))


def write_tokenizer_files(tokenizer, out, *, model_max_length: int, chat_template_file=None,
                          generation: dict | None = None) -> dict[str, int]:
    """Writes the tokenizer files and generation_config.json of the module docstring into `out`.

    Args:
      tokenizer: a tokenizer.json (or a folder holding one); its chat template comes from the
        tokenizer_config.json beside it, or the bundled template for the bundled tokenizer.
      out: the HF folder being written.
      model_max_length: the model's context (max_position_embeddings).
      chat_template_file: a template file used instead of the tokenizer's (a run's data.chat_template).
      generation: the source's generation_config (its sampling defaults are kept).

    Returns:
      {"bos_token_id", "eos_token_id", "pad_token_id"} for config.json.
    """
    from dsv3_jax.data.chat_template import ChatTokenizer

    chat = ChatTokenizer(tokenizer, template_file=chat_template_file)
    tok, out = chat.tokenizer, pathlib.Path(out)
    _write_with_bos(tok, chat.path, out / "tokenizer.json")
    source_config = chat.path.parent / "tokenizer_config.json"
    config = json.loads(source_config.read_text(encoding="utf-8")) if source_config.is_file() else {}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")  # any HF tokenizer.json loads as this
    config.update(chat.specials, model_max_length=model_max_length, add_bos_token=True, add_eos_token=False)
    config.setdefault("clean_up_tokenization_spaces", False)  # decode gives back the text as encoded
    if chat.template is not None:
        config["chat_template"] = chat.template
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    gen = {**(generation or {}), "bos_token_id": tok.bos_id, "pad_token_id": tok.pad_id}
    eos = gen.get("eos_token_id")
    eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    eos += [] if tok.eos_id in eos else [tok.eos_id]  # the tokenizer's EOS ends every assistant turn
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    files = {"tokenizer_config.json": config, "special_tokens_map.json": chat.specials, GENERATION_CONFIG: gen}
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return ids


def _write_with_bos(tok, source: pathlib.Path, path: pathlib.Path) -> None:
    """Writes `tok`'s tokenizer.json to `path` so that its default encoding is BOS + the text's ids
    (a TemplateProcessing post-processor; a file that already does this is copied unchanged). The
    chat template writes BOS itself, and transformers renders it without special tokens."""
    hf, probe = tok.hf, "The man said"
    if hf.encode(probe).ids == [tok.bos_id] + hf.encode(probe, add_special_tokens=False).ids:
        shutil.copy(source, path)
        return
    bos = hf.id_to_token(tok.bos_id)
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.bos_id)])
    hf.save(str(path))

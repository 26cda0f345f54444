"""The export's tokenizer and generation files: what HF's own loaders read from them, and what
HF -> Orbax -> HF keeps of a source's generation_config.json and tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from dsv3_jax.checkpoint.hf_tokenizer import read_generation_config
from dsv3_jax.data.tokenizer import BUNDLED_PATH
from tests.checkpoint.conftest import convert

SOURCE_GENERATION = {"bos_token_id": 0, "eos_token_id": [1, 5], "do_sample": True, "temperature": 0.6, "top_p": 0.95}


@pytest.fixture(scope="module")
def source_with_tokenizer(hf_folders, tmp_path_factory):
    """The fp32 synthetic HF folder plus a generation_config.json and the bundled tokenizer with a
    tokenizer_config.json of its own (a class name and a template the export must keep)."""
    src = tmp_path_factory.mktemp("src") / "hf"
    shutil.copytree(hf_folders["fp32"], src)
    (src / "generation_config.json").write_text(json.dumps(SOURCE_GENERATION))
    shutil.copy(BUNDLED_PATH, src / "tokenizer.json")
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
         "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}", "legacy": True}))
    return src


def test_convert_keeps_generation_config_and_tokenizer(source_with_tokenizer, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    assert convert("--hf-dir", source_with_tokenizer, "--out", ckpt) == 0
    defaults = read_generation_config(ckpt)  # generate / serve on the Orbax checkpoint see the source's
    assert defaults.eos_ids == (1, 5) and defaults.temperature == 0.6 and defaults.top_p == 0.95
    assert (ckpt / "tokenizer.json").read_bytes() == BUNDLED_PATH.read_bytes()
    assert convert("--to-hf", "--ckpt", ckpt, "--out", out) == 0
    gen = json.loads((out / "generation_config.json").read_text())
    # the source's sampling defaults and eos ids, plus the tokenizer's EOS (2) and its bos/pad
    assert gen == {**SOURCE_GENERATION, "bos_token_id": 1, "pad_token_id": 0, "eos_token_id": [1, 5, 2]}
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["legacy"] is True and tok_config["chat_template"].startswith("{% for m in")
    assert read_generation_config(out).eos_ids == (1, 5, 2)


def test_export_loads_in_autotokenizer_with_specials_and_template(source_with_tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    from dsv3_jax.checkpoint import orbax_to_hf
    from dsv3_jax.serving.chat import BUNDLED_TEMPLATE

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    src = tmp_path / "src"
    shutil.copytree(source_with_tokenizer, src)
    (src / "tokenizer_config.json").unlink()  # the bundled tokenizer alone: its specials and template are ours
    assert convert("--hf-dir", src, "--out", ckpt) == 0
    orbax_to_hf.convert_orbax_to_hf(ckpt, out, progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert tok.chat_template == BUNDLED_TEMPLATE
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|bos|>User: 2+2?\n\nAssistant: 4.<|eos|>\n\n"
    special_map = json.loads((out / "special_tokens_map.json").read_text())
    assert special_map == {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


@pytest.mark.parametrize("raw", [
    {"eos_token_id": [1, 5], "do_sample": True, "temperature": 0.6, "top_p": 0.95},
    {"eos_token_id": 2, "do_sample": False, "temperature": 0.7, "max_new_tokens": 9},
    {"eos_token_id": 3, "do_sample": True, "top_k": 7},
])
def test_generation_defaults_read_as_transformers_reads_them(tmp_path, raw):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    ours, theirs = read_generation_config(tmp_path), transformers.GenerationConfig.from_pretrained(tmp_path)
    eos = theirs.eos_token_id
    assert ours.eos_ids == tuple(eos if isinstance(eos, list) else [eos])
    # HF samples only with do_sample (at temperature 1 unless set); greedy otherwise, whatever temperature says
    sampled_at = 1.0 if theirs.temperature is None else theirs.temperature
    assert ours.temperature == (sampled_at if theirs.do_sample else 0.0)
    assert ours.top_p == theirs.top_p and ours.top_k == theirs.top_k
    assert ours.max_new_tokens == theirs.max_new_tokens


TEXTS = ["hi", "The man said", "  two  spaces\nand a line", "naïve café 東京", "a <|eos|> inside", ""]
BOS_ONLY = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [1], "tokens": ["<|bos|>"]}}}
BOS_AND_EOS = {**BOS_ONLY, "single": [*BOS_ONLY["single"], {"SpecialToken": {"id": "<|eos|>", "type_id": 0}}],
               "special_tokens": {**BOS_ONLY["special_tokens"],
                                  "<|eos|>": {"id": "<|eos|>", "ids": [2], "tokens": ["<|eos|>"]}}}


@pytest.mark.parametrize("post_processor", [None, BOS_ONLY, BOS_AND_EOS], ids=["none", "bos", "bos_and_eos"])
def test_export_tokenizes_text_as_generate_and_serve_do(tmp_path, post_processor):
    """transformers' default tokenization of the export (`add_special_tokens=True`) is ours: BOS, then
    the text's ids, whatever the source tokenizer.json's post-processor did (none: the bundled BPE;
    BOS only: DeepSeek-V3's, kept byte for byte; BOS and EOS: replaced). Chat prompts get one BOS."""
    transformers = pytest.importorskip("transformers")
    from dsv3_jax.checkpoint.hf_tokenizer import write_tokenizer_files
    from dsv3_jax.data.chat_template import BUNDLED_TEMPLATE, ChatTokenizer
    from dsv3_jax.data.tokenizer import load_tokenizer

    (tmp_path / "template.jinja").write_text(BUNDLED_TEMPLATE)
    source = json.loads(BUNDLED_PATH.read_text(encoding="utf-8"))
    source["post_processor"] = post_processor
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tokenizer.json").write_text(json.dumps(source), encoding="utf-8")
    out = tmp_path / "hf"
    out.mkdir()
    write_tokenizer_files(tmp_path / "src", out, model_max_length=64, chat_template_file=tmp_path / "template.jinja")
    ours = load_tokenizer(BUNDLED_PATH)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    expected = [[ours.bos_id] + ours.encode(text) for text in TEXTS]
    assert [theirs(text)["input_ids"] for text in TEXTS] == expected
    assert theirs(TEXTS)["input_ids"] == expected
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True
    if post_processor is BOS_ONLY:
        assert (out / "tokenizer.json").read_bytes() == (tmp_path / "src" / "tokenizer.json").read_bytes()
    messages = [{"role": "user", "content": "2+2?"}]
    chat = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat == ChatTokenizer(BUNDLED_PATH).encode_chat(messages) and chat.count(ours.bos_id) == 1

"""The bundled BPE: size, special ids, round trips, reproducibility; loading other files."""

import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from dsv3_jax.data import corpus, make_tokenizer
from dsv3_jax.data import tokenizer as tokenizer_lib

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "  Leading spaces, trailing tabs\t\nand a second line; numbers 1,234.56 and (parens)!",
    "Unicode survives byte-level BPE: naïve café, Ωmega, 東京, emoji 🎉.",
    "",
]


def test_bundled_vocab_and_special_ids(tokenizer):
    assert tokenizer.vocab_size == 2048
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert [tokenizer.hf.id_to_token(i) for i in range(3)] == ["<|pad|>", "<|bos|>", "<|eos|>"]


@pytest.mark.parametrize("text", ENGLISH + list(corpus.fortune_documents()[:50:7]))
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(isinstance(i, int) and 0 <= i < 2048 for i in ids)
    assert tokenizer.decode(ids) == text


def test_compresses_english(tokenizer):
    text = "\n".join(corpus.fortune_documents()[:200])
    assert len(tokenizer.encode(text)) < 0.4 * len(text.encode())  # Bytes per token > 2.5.


def test_special_tokens_are_single_ids(tokenizer):
    ids = tokenizer.hf.encode("<|bos|>hi<|eos|>", add_special_tokens=False).ids
    assert ids == [1, *tokenizer.encode("hi"), 2]
    assert tokenizer.decode([1, *tokenizer.encode("hi"), 2], skip_special_tokens=True) == "hi"


def test_make_tokenizer_reproduces_the_committed_asset(tmp_path):
    out = tmp_path / "tokenizer.json"
    make_tokenizer.main(["--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(tokenizer_lib.BUNDLED_PATH.read_text())


def _deepseek_style_file(folder, with_config: bool):
    """A tiny tokenizer.json with DeepSeek-V3's special-token names (full-width bars)."""
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    vocab = {bos: 0, eos: 1, "a": 2, "b": 3, "ab": 4, "Ġ": 5}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens([bos, eos, "<｜fim▁hole｜>"])
    tok.save(str(folder / "tokenizer.json"))
    if with_config:
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": {"__type": "AddedToken", "content": bos}, "eos_token": {"content": eos},
            "pad_token": {"content": eos}}))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("with_config", [True, False])
def test_loads_deepseek_style_tokenizer(tmp_path, with_config):
    path = _deepseek_style_file(tmp_path, with_config)
    tok = tokenizer_lib.load_tokenizer(tmp_path if with_config else path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)
    assert tok.encode("abab") == [4, 4]
    assert tok.vocab_size == 7


def test_overrides_and_unknown_specials(tmp_path):
    tok = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "[X]": 2}, merges=[]))
    tok.add_special_tokens(["[X]"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match=f"{path}.*bos"):
        tokenizer_lib.load_tokenizer(path)
    loaded = tokenizer_lib.load_tokenizer(path, bos="[X]", eos=1, pad=0)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (2, 1, 0)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tokenizer_lib.load_tokenizer(path, bos="<missing>", eos=1)

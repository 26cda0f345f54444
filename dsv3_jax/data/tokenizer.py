"""A small tokenizer wrapper over HF `tokenizers`, for the bundled BPE or any `tokenizer.json`.

Bundled tokenizer (`assets/tokenizer.json`, made by `python -m dsv3_jax.data.make_tokenizer`):
byte-level BPE, vocab 2048 in total, special tokens `<|pad|>` = 0, `<|bos|>` = 1, `<|eos|>` = 2.

A user file (DeepSeek-V3's own `tokenizer.json`, or any HF tokenizers file) names its special
tokens in one of three ways, tried in this order: the `bos`/`eos`/`pad` arguments (token strings
or ids); a `tokenizer_config.json` beside the file (HF folders carry one, with `bos_token`,
`eos_token`, `pad_token`); the file's own special tokens, recognised by name (`<|bos|>`,
`<｜begin▁of▁sentence｜>`, `<s>`, ... see `_BOS_NAMES`). Without a pad token, pad = eos: padded
positions have segment id 0 and are masked, so the pad value only has to be a valid id.
"""

import dataclasses
import json
import pathlib

import tokenizers

BUNDLED_PATH = pathlib.Path(__file__).parent / "assets" / "tokenizer.json"
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # In id order: pad 0, bos 1, eos 2.

_BOS_NAMES = (BOS, "<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<s>", "<bos>", "[BOS]")
_EOS_NAMES = (EOS, "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]")
_PAD_NAMES = (PAD, "<｜▁pad▁｜>", "<pad>", "[PAD]", "<|padding|>")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text <-> token ids, plus the special ids the data pipeline needs.

    Attributes:
      hf: the underlying `tokenizers.Tokenizer`.
      bos_id, eos_id, pad_id: special token ids.
      path: the file it was loaded from.
    """

    hf: tokenizers.Tokenizer = dataclasses.field(repr=False)
    bos_id: int
    eos_id: int
    pad_id: int
    path: str

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included; every id the tokenizer emits is below it."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Returns the ids of `text`, without BOS/EOS (the pipeline adds them per document)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_tokenizer(path=None, *, bos=None, eos=None, pad=None) -> Tokenizer:
    """Loads the bundled tokenizer (`path=None`) or a `tokenizer.json` (or a folder holding one).

    Args:
      path: None, a `tokenizer.json` file, or an HF model folder that contains one.
      bos, eos, pad: optional overrides, each a token string or an int id.

    Returns:
      A `Tokenizer`. Raises ValueError naming the file if BOS or EOS cannot be determined.
    """
    file = pathlib.Path(path) if path is not None else BUNDLED_PATH
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"No tokenizer file at {file}.")
    try:
        hf = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files.
        raise ValueError(f"{file} is not a valid HF tokenizers file: {e}") from e
    config = read_tokenizer_config(file.parent / "tokenizer_config.json")
    specials = [t.content for t in hf.get_added_tokens_decoder().values() if t.special]

    def resolve(kind, override, names, default=None):
        token = override
        if token is None:  # tokenizer_config.json's: a string, or an AddedToken {"content": ...}
            token = config.get(kind)
            token = token.get("content") if isinstance(token, dict) else token
            token = token if isinstance(token, str) else None
        if token is None:
            token = next((n for n in names if n in specials), None)
        if token is None:
            if default is not None:
                return default
            raise ValueError(
                f"{file}: cannot tell which token is {kind}; its special tokens are {specials[:8]}. "
                f"Pass load_tokenizer(..., {kind.split('_')[0]}=<token or id>).")
        if isinstance(token, int):
            if not 0 <= token < hf.get_vocab_size(with_added_tokens=True):
                raise ValueError(f"{file}: {kind} id {token} is outside the vocabulary.")
            return token
        token_id = hf.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{file}: {kind} {token!r} is not in the vocabulary.")
        return token_id

    bos_id = resolve("bos_token", bos, _BOS_NAMES)
    eos_id = resolve("eos_token", eos, _EOS_NAMES)
    pad_id = resolve("pad_token", pad, _PAD_NAMES, default=eos_id)
    return Tokenizer(hf=hf, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, path=str(file))


def read_tokenizer_config(path: pathlib.Path) -> dict:
    """The HF `tokenizer_config.json` at `path` (special tokens, chat template), or {} without one."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

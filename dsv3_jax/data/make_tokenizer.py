"""Trains the bundled byte-level BPE tokenizer on the fortune corpus and writes it to assets/.

    python -m dsv3_jax.data.make_tokenizer [--out=PATH] [--vocab_size=2048]

Vocab size counts everything: 3 special tokens (`<|pad|>` = 0, `<|bos|>` = 1, `<|eos|>` = 2),
the 256 byte symbols, and the learned merges. Training is offline and takes about a second.
"""

import pathlib
import sys

import tokenizers
from absl import flags
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dsv3_jax import cli
from dsv3_jax.data import corpus
from dsv3_jax.data import tokenizer as tokenizer_lib


def train_bpe(documents, vocab_size: int = 2048) -> tokenizers.Tokenizer:
    """Returns a byte-level BPE with `vocab_size` ids in total, special tokens first. Its default
    encoding (HF's `add_special_tokens=True`) puts BOS in front, as our tokenization of a prompt or
    document does, so that transformers and the server's `/tokenizer_info` agree with us."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(tokenizer_lib.SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} ids, not {vocab_size=}: the corpus has too "
                           "few distinct merges for that size.")
    for want_id, token in enumerate(tokenizer_lib.SPECIAL_TOKENS):
        assert tok.token_to_id(token) == want_id, (token, tok.token_to_id(token))
    bos = tokenizer_lib.BOS
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("out", str(tokenizer_lib.BUNDLED_PATH), "where to write tokenizer.json", flag_values=fv)
    flags.DEFINE_integer("vocab_size", 2048, "ids in total: specials, the 256 bytes and the merges", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    tok = train_bpe(corpus.fortune_documents(), args.vocab_size)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    print(f"wrote {out}: vocab {tok.get_vocab_size()}, "
          f"pad/bos/eos = {[tok.token_to_id(t) for t in tokenizer_lib.SPECIAL_TOKENS]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Trains the bundled byte-level BPE tokenizer on the fortune corpus and writes it to assets/.

    python -m dsv3_jax.data.make_tokenizer [--out PATH] [--vocab_size 2048]

Vocab size counts everything: 3 special tokens (`<|pad|>` = 0, `<|bos|>` = 1, `<|eos|>` = 2),
the 256 byte symbols, and the learned merges. Training is offline and takes about a second.
"""

import argparse
import pathlib

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=tokenizer_lib.BUNDLED_PATH)
    parser.add_argument("--vocab_size", type=int, default=2048)
    args = parser.parse_args(argv)
    tok = train_bpe(corpus.fortune_documents(), args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    print(f"wrote {args.out}: vocab {tok.get_vocab_size()}, "
          f"pad/bos/eos = {[tok.token_to_id(t) for t in tokenizer_lib.SPECIAL_TOKENS]}")


if __name__ == "__main__":
    main()

"""Incremental detokenization: the streamed deltas equal one decode of the whole continuation, and
each token decodes a bounded window (the work per token does not grow with the text)."""

import numpy as np
import pytest

from dsv3_jax.data import load_tokenizer
from dsv3_jax.serving.textstream import TextStream


class CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.mark.parametrize("seed", range(4))
def test_deltas_equal_the_whole_decode_with_bounded_windows(tok, seed):
    """Random ids (byte pieces that split UTF-8 characters, special tokens) one at a time."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, tok.vocab_size, 300).tolist()
    counting = CountingTokenizer(tok)
    stream = TextStream(counting, [])
    deltas = [stream.push([i]) for i in ids]
    tail = stream.finish()
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)
    # a window is the context kept plus the ids not yet whole characters (a UTF-8 char is <= 4 bytes)
    assert max(counting.lengths) <= 5 + 4 + 1, "each push must decode a short window, not the whole text"


def test_text_of_whole_words_streams_unchanged(tok):
    text = " ".join(["fox", "ünïcode", "—", "jumps", "over", "the", "lazy", "dog."] * 20)
    stream = TextStream(tok, [])
    deltas = [stream.push([i]) for i in tok.encode(text)]
    assert "".join(deltas) + stream.finish() == text
    assert all("\ufffd" not in d for d in deltas)

"""The offline reference for served log-probabilities: the served checkpoint loaded in the test
process and run as one full forward (no cache, no chunks, no server) in fp32, log-softmax in numpy."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from dsv3_jax import load_pretrained


class FullForward:
    """log p(. | prefix) at every position of token sequences, one compile for all (padded to `length`)."""

    def __init__(self, checkpoint, length: int):
        graphdef, self.state = nnx.split(load_pretrained(str(checkpoint)))
        self.length = length
        self._logits = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))

    def logits(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """float64 [len(seq), V] raw logits per sequence: row i scores the token after seq[:i + 1]."""
        out = []
        for start in range(0, len(sequences), 8):  # batches of 8 rows: one compiled shape
            batch = sequences[start:start + 8]
            tokens = np.zeros((8, self.length), np.int32)
            for row, seq in enumerate(batch):
                tokens[row, :len(seq)] = seq
            logits = np.asarray(self._logits(self.state, tokens), np.float64)
            out += [logits[row, :len(seq)] for row, seq in enumerate(batch)]
        return out

    def logprobs(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """float64 [len(seq), V] per sequence: row i is the distribution of the token after seq[:i + 1]."""
        return [log_softmax(x) for x in self.logits(sequences)]

    def scored(self, sequence: list[int]) -> np.ndarray:
        """float64 [len - 1]: log p(sequence[i] | sequence[:i]) for i >= 1."""
        lp = self.logprobs([sequence])[0]
        return lp[np.arange(len(sequence) - 1), sequence[1:]]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@functools.lru_cache(maxsize=2)
def full_forward(checkpoint, length: int) -> FullForward:
    return FullForward(checkpoint, length)

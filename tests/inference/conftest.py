"""Tiny fp32 models with O(1) logits (so greedy choices are not near-ties) and their references."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3, ModelConfig

VOCAB = 64


@contextlib.contextmanager
def jax_compiles():
    """Every jit trace and backend compile (jax's own compile events, any thread) during the block."""
    events = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
    seen = []

    def listener(event, seconds, **kwargs):
        if event in events:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig.tiny(vocab_size=VOCAB, initializer_range=0.3, **overrides)


def full_forward_greedy(model, prompts: np.ndarray, lengths: np.ndarray, max_new: int):
    """Independent reference: re-run the full-sequence forward and take the argmax, token by token.

    Returns (tokens [B, T + max_new] laid out like `generate`, smallest top-1 minus top-2 logit gap).
    """
    b, t = prompts.shape
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    seq = np.zeros((b, t + max_new), np.int32)
    seq[:, :t] = np.where(np.arange(t)[None] < lengths[:, None], prompts, 0)
    cur, rows, gap = lengths.copy(), np.arange(b), np.inf
    for _ in range(max_new):
        last = np.asarray(forward(state, jnp.asarray(seq)))[rows, cur - 1]  # causal: later slots are ignored
        top2 = np.sort(last, axis=-1)[:, -2:]
        gap = min(gap, float(np.min(top2[:, 1] - top2[:, 0])))
        seq[rows, cur] = last.argmax(-1)
        cur += 1
    return seq, gap


@pytest.fixture(scope="session")
def model():
    return DeepSeekV3(tiny_config(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def ragged_batch():
    prompts = np.random.RandomState(0).randint(0, VOCAB, (3, 7)).astype(np.int32)
    lengths = np.array([7, 4, 1], np.int32)
    prompts[1, 4:] = -1  # padding may hold anything
    return prompts, lengths


MAX_NEW = 8


@pytest.fixture(scope="session")
def greedy_reference(model, ragged_batch):
    prompts, lengths = ragged_batch
    return full_forward_greedy(model, prompts, lengths, MAX_NEW)

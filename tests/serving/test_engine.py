"""Continuous batching against `generate()` alone, cancellation, the bounded queue."""

import threading
import time

import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.data import load_tokenizer
from dsv3_jax.inference import generate
from dsv3_jax.serving import Engine, QueueFull, Request, Runner, SamplingParams
from tests.inference.conftest import VOCAB, tiny_config

MAX_BATCH, CHUNK = 8, 16


@pytest.fixture(scope="module")
def model():
    return DeepSeekV3(tiny_config(), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def engine(model):
    runner = Runner(model, max_batch=MAX_BATCH, max_seq_len=64, chunk=CHUNK)
    runner.warm_up()
    eng = Engine(runner, load_tokenizer(), max_queue=4)
    eng.start()
    yield eng
    eng.shutdown()


class Collector:
    def __init__(self):
        self.tokens, self.done = [], threading.Event()
        self.reason = None

    def __call__(self, ev):
        self.tokens.extend(ev.token_ids)
        if ev.finish_reason is not None:
            self.reason = ev.finish_reason
            self.done.set()


def test_sixteen_staggered_greedy_requests_equal_generate_alone(model, engine):
    """Different prompt lengths (two of them longer than a prefill chunk) and output lengths,
    submitted while others decode; 16 requests on 8 slots, so half of them reuse a freed slot."""
    rng = np.random.RandomState(0)
    lengths = [3, 8, 17, 30] * 4
    max_tokens = [4 + (5 * i) % 13 for i in range(16)]
    prompts = [rng.randint(0, VOCAB, n).tolist() for n in lengths]
    engine.max_queue = 16
    sinks = [Collector() for _ in prompts]
    for prompt, n, sink in zip(prompts, max_tokens, sinks):
        engine.submit(Request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), sink))
        time.sleep(rng.uniform(0, 0.05))
    for sink in sinks:
        assert sink.done.wait(300), "a request never finished"
    assert engine.slots_in_use() == 0 and engine.queue_length() == 0
    runner = engine.runner  # compiled once per prefill width and once for decode, whatever the lengths
    assert runner._prefill._cache_size() == len(runner.buckets) and runner._decode._cache_size() == 1
    for i, (prompt, n, sink) in enumerate(zip(prompts, max_tokens, sinks)):
        alone = np.asarray(generate(model, np.array([prompt], np.int32), n))[0, len(prompt):]
        assert sink.tokens == alone.tolist(), f"request {i} (prompt {len(prompt)}, max_tokens {n})"
        assert sink.reason == "length"


def test_mtp_speculation_keeps_greedy_output(model):
    """With MTP drafts verified per slot, greedy requests still equal plain generate() alone."""
    runner = Runner(model, max_batch=4, max_seq_len=64, chunk=CHUNK, use_mtp=True)
    eng = Engine(runner, load_tokenizer(), max_queue=16)
    eng.start()
    try:
        rng = np.random.RandomState(1)
        prompts = [rng.randint(0, VOCAB, n).tolist() for n in (3, 8, 17, 30, 8, 3)]
        max_tokens = [12, 9, 14, 7, 16, 11]
        sinks = [Collector() for _ in prompts]
        for prompt, n, sink in zip(prompts, max_tokens, sinks):
            eng.submit(Request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), sink))
        for sink in sinks:
            assert sink.done.wait(300), "a request never finished"
    finally:
        eng.shutdown()
    for i, (prompt, n, sink) in enumerate(zip(prompts, max_tokens, sinks)):
        alone = np.asarray(generate(model, np.array([prompt], np.int32), n))[0, len(prompt):]
        assert sink.tokens == alone.tolist(), f"request {i} (prompt {len(prompt)}, max_tokens {n})"
    m = eng.metrics
    assert m.proposed_drafts > 0 and 0 <= m.accepted_drafts <= m.proposed_drafts


def test_cancel_frees_the_slot_at_once(engine):
    sink = Collector()
    request = engine.submit(Request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), sink))
    deadline = time.time() + 120
    while len(sink.tokens) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert engine.slots_in_use() == 1
    engine.cancel(request)
    assert engine.slots_in_use() == 0, "cancel must free the slot before it returns"
    assert 3 <= len(sink.tokens) < 50 and request.done


def test_full_queue_refuses(engine):
    engine.max_queue = 0
    try:
        with pytest.raises(QueueFull, match="queue is full"):
            engine.submit(Request([1], SamplingParams(max_tokens=1), Collector()))
    finally:
        engine.max_queue = 16

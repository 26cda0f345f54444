"""The server on a paged cache too small for its requests: sixteen concurrent greedy requests of mixed
lengths, the newest preempted when the pages run short and resumed by prefilling what they have,
answer as `generate()` alone, with and without MTP, and every page comes back."""

import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.data import load_tokenizer
from dsv3_jax.inference import generate
from dsv3_jax.serving import Engine, Request, Runner, SamplingParams
from tests.helpers import TokenSink
from tests.inference.conftest import VOCAB, tiny_config

LENGTHS = [3, 8, 17, 30, 1, 12, 25, 5, 40, 9, 2, 21, 14, 33, 6, 11]
MAX_TOKENS = [12, 9, 14, 7, 16, 11, 5, 13, 8, 15, 10, 6, 12, 4, 17, 9]


@pytest.fixture(scope="module")
def model():
    return DeepSeekV3(tiny_config(), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(1)
    return [rng.randint(0, VOCAB, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each request's greedy tokens from generate() on its own (the contiguous cache)."""
    return [np.asarray(generate(model, np.array([p], np.int32), n))[0, len(p):].tolist()
            for p, n in zip(prompts, MAX_TOKENS)]


@pytest.mark.parametrize("use_mtp", [False, True])
def test_sixteen_requests_on_too_few_pages_preempt_and_answer_as_generate_alone(model, prompts, alone, use_mtp):
    """Four slots on 12 pages of 8 tokens, requests needing up to 7 pages each: the pool runs short,
    and requests are preempted with tokens generated, which their resumed prefill reads back."""
    runner = Runner(model, max_batch=4, max_seq_len=64, chunk=16, use_mtp=use_mtp, page_size=8, cache_tokens=96)
    resumed, admit = [], runner.admit

    def admit_spy(slot, request, tokens, **kwargs):
        resumed.extend([request] if len(tokens) > len(request.prompt) else [])
        return admit(slot, request, tokens, **kwargs)

    runner.admit = admit_spy
    eng = Engine(runner, load_tokenizer(), max_queue=16)
    sinks = [TokenSink() for _ in prompts]
    for prompt, n, sink in zip(prompts, MAX_TOKENS, sinks):  # all queued before the engine runs: one schedule
        eng.submit(Request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), sink))
    eng.start()
    try:
        for sink in sinks:
            assert sink.done.wait(300), "a request never finished"
    finally:
        eng.shutdown()
    for i, sink in enumerate(sinks):
        assert sink.tokens == alone[i], f"request {i} (prompt {LENGTHS[i]}, max_tokens {MAX_TOKENS[i]})"
    assert eng.metrics.preemptions > 0 and resumed
    assert runner.cache_tokens_used == 0 and (runner.table == -1).all()  # every page back once all ended
    health = eng.health()
    assert (health["cache_tokens_used"], health["cache_tokens_total"]) == (0, 96)

"""Continuous batching on the paged cache against `generate()` alone, cancellation, the bounded queue,
recovery from a failed step, preemption and prefix sharing."""

import contextlib
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.data import load_tokenizer
from dsv3_jax.inference import generate, steps
from dsv3_jax.serving import Engine, QueueFull, Request, Runner, SamplingParams
from dsv3_jax.serving.engine import EngineFailed
from tests.helpers import TokenSink, app_in_thread, http_json
from tests.inference.conftest import VOCAB, jax_compiles, tiny_config

MAX_BATCH, CHUNK = 8, 16


@pytest.fixture(scope="module")
def model():
    return DeepSeekV3(tiny_config(), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def engine(model):
    # Runners of one graph share their jitted steps (`steps.compiled`): a fresh set here, so what
    # warm-up compiled is this runner's alone, whichever tests ran before in this process.
    steps.compiled.cache_clear()
    runner = Runner(model, max_batch=MAX_BATCH, max_seq_len=64, chunk=CHUNK)
    runner.warm_up()
    # one program per prefill width and per decode bucket (1, 2, 4, 8 rows), whatever the lengths
    assert runner.steps.prefill._cache_size() == 1
    assert runner.steps.decode._cache_size() == len(runner.decode_buckets) == 4
    eng = Engine(runner, load_tokenizer(), max_queue=4)
    eng.start()
    yield eng
    eng.shutdown()


@contextlib.contextmanager
def queue_limit(engine, max_queue: int):
    """The shared engine with another queue limit for the block, restored after it."""
    before, engine.max_queue = engine.max_queue, max_queue
    try:
        yield
    finally:
        engine.max_queue = before


def test_sixteen_staggered_greedy_requests_equal_generate_alone(model, engine):
    """Different prompt lengths (two of them longer than a prefill chunk) and output lengths,
    submitted while others decode; 16 requests on 8 slots, so half of them reuse a freed slot."""
    rng = np.random.RandomState(0)
    lengths = [3, 8, 17, 30] * 4
    max_tokens = [4 + (5 * i) % 13 for i in range(16)]
    prompts = [rng.randint(0, VOCAB, n).tolist() for n in lengths]
    sinks = [TokenSink() for _ in prompts]
    with queue_limit(engine, 16), jax_compiles() as compiles:
        for prompt, n, sink in zip(prompts, max_tokens, sinks):
            engine.submit(Request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), sink))
            time.sleep(rng.uniform(0, 0.05))
        for sink in sinks:
            assert sink.done.wait(300), "a request never finished"
    assert compiles == [], "warm-up must compile every shape a request meets"
    health = engine.health()
    assert health["slots_in_use"] == 0 and health["queue_length"] == 0
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
        sinks = [TokenSink() for _ in prompts]
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
    sink = TokenSink()
    request = engine.submit(Request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), sink))
    deadline = time.time() + 120
    while len(sink.tokens) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert engine.health()["slots_in_use"] == 1
    engine.cancel(request)
    assert engine.health()["slots_in_use"] == 0, "cancel must free the slot before it returns"
    assert 3 <= len(sink.tokens) < 50 and request.done


def test_full_queue_refuses(engine):
    with queue_limit(engine, 0):
        with pytest.raises(QueueFull, match="queue is full"):
            engine.submit(Request([1], SamplingParams(max_tokens=1), TokenSink()))
    assert engine.max_queue == 4, "the shared engine's queue limit must be restored"


class FailingDecode:
    """A real Runner whose next decode, once armed, fails as a step can on a device: the donated
    cache is consumed (its buffers deleted) and the step raises. Without a reset every later step
    would fail on the deleted cache."""

    def __init__(self, runner, *, reset_fails: bool = False):
        self.runner, self.armed, self.reset_fails = runner, threading.Event(), reset_fails

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def decode(self, *args):
        if self.armed.is_set():
            self.armed.clear()
            for a in jax.tree.leaves(self.runner.cache):
                a.delete()
            raise RuntimeError("injected: device step failed")
        return self.runner.decode(*args)

    def reset(self):
        if self.reset_fails:
            raise RuntimeError("injected: cannot allocate the cache")
        self.runner.reset()


def serving(engine):
    """`make_app` over the engine on 127.0.0.1 (uvicorn in a thread); yields its base url."""
    from dsv3_jax.serving import ChatTokenizer, make_app
    from dsv3_jax.data.tokenizer import BUNDLED_PATH

    return app_in_thread(make_app(engine, ChatTokenizer(BUNDLED_PATH), "m"))


def test_failed_step_ends_requests_with_an_error_and_the_engine_recovers(model):
    """The injected failure ends the in-flight requests with "error"; /health reports it; the cache is
    rebuilt, so the next requests equal generate() alone. Same shapes as the shared engine: no compile."""
    runner = FailingDecode(Runner(model, max_batch=MAX_BATCH, max_seq_len=64, chunk=CHUNK))
    eng = Engine(runner, load_tokenizer(), max_queue=4)
    eng.start()
    try:
        with serving(eng) as url:
            first = [TokenSink() for _ in range(2)]
            for sink in first:
                eng.submit(Request([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True), sink))
            deadline = time.time() + 120
            while sum(len(s.tokens) for s in first) < 4 and time.time() < deadline:
                time.sleep(0.01)
            runner.armed.set()
            for sink in first:
                assert sink.done.wait(120) and sink.reason == "error"
            status, health = http_json(url + "/health")
            assert status == 200 and health["resets"] == 1 and health["status"] in ("ok", "recovering")
            assert "injected: device step failed" in health["last_error"]
            prompt, sink = [9, 4, 33, 2, 17], TokenSink()
            eng.submit(Request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), sink))
            assert sink.done.wait(120) and sink.reason == "length"
            assert http_json(url + "/health")[1]["status"] == "ok"
    finally:
        eng.shutdown()
    alone = np.asarray(generate(model, np.array([prompt], np.int32), 6))[0, len(prompt):]
    assert sink.tokens == alone.tolist()


def test_a_reset_that_fails_leaves_the_engine_failed(model):
    runner = FailingDecode(Runner(model, max_batch=MAX_BATCH, max_seq_len=64, chunk=CHUNK), reset_fails=True)
    eng = Engine(runner, load_tokenizer(), max_queue=4)
    eng.start()
    try:
        with serving(eng) as url:
            runner.armed.set()
            sink = TokenSink()
            eng.submit(Request([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True), sink))
            assert sink.done.wait(120) and sink.reason == "error"
            # The in-flight request ends before the reset runs, so /health says "recovering" until it fails.
            deadline = time.monotonic() + 120
            while (health := http_json(url + "/health"))[1]["status"] == "recovering" and time.monotonic() < deadline:
                time.sleep(0.05)
            status, health = health
            assert status == 503 and health["status"] == "failed" and "cannot allocate" in health["last_error"]
            with pytest.raises(EngineFailed, match="could not recover"):
                eng.submit(Request([1], SamplingParams(max_tokens=1), TokenSink()))
    finally:
        eng.shutdown()


class PoolSink(TokenSink):
    """A token sink that also records, at each of its events, the pages every admitted request holds
    (from the engine thread, between steps) and the pool's held page count."""

    def __init__(self, pool_of):
        super().__init__()
        self.pool_of, self.snapshots = pool_of, []

    def __call__(self, event):
        pool = self.pool_of()
        self.snapshots.append((pool.held_pages, [list(r.pages) for r in pool.requests.values()]))
        super().__call__(event)


def _submit_together(eng, prompts, max_tokens, **params) -> list[PoolSink]:
    """Queues every request before the engine's next admission (submit re-enters the held lock)."""
    sinks = [PoolSink(lambda: eng.runner.pools[0]) for _ in prompts]
    with eng.cond:
        for prompt, n, sink in zip(prompts, max_tokens, sinks):
            eng.submit(Request(prompt, SamplingParams(max_tokens=n, ignore_eos=True, **params), sink))
    for sink in sinks:
        assert sink.done.wait(300) and sink.reason == "length"
    return sinks


def _alone(model, prompt, n) -> list[int]:
    return np.asarray(generate(model, np.array([prompt], np.int32), n))[0, len(prompt):].tolist()


def test_shared_prompt_pages_are_held_once_reused_evicted_and_answers_stay_exact(model):
    """The paged preemption test's shapes (no new compile). Pages of 8, chunks of 16: a granule of 2
    pages. Three requests sharing a 2-chunk prefix hold its 4 pages once; opted-out and echo requests
    reuse nothing; three distinct prompts needing 21 pages on 12 evict the cached prefix and preempt."""
    runner = Runner(model, max_batch=4, max_seq_len=64, chunk=CHUNK, page_size=8, cache_tokens=96)
    eng = Engine(runner, load_tokenizer(), max_queue=16, prefix_cache=1)
    eng.start()
    rng = np.random.RandomState(3)
    prefix = rng.randint(0, VOCAB, 2 * CHUNK).tolist()
    shared = [prefix + rng.randint(0, VOCAB, n).tolist() for n in (3, 5, 2)]
    distinct = [rng.randint(0, VOCAB, 30).tolist() for _ in range(3)]
    hits = []
    try:
        first, = _submit_together(eng, shared[:1], [5])  # cold: publishes the prefix's two granules
        published = first.snapshots[0][1][0][:4]
        hits.append(eng.metrics.prefix_hit_tokens)
        together = _submit_together(eng, shared, [5, 5, 5])
        hits.append(eng.metrics.prefix_hit_tokens)
        opted_out, = _submit_together(eng, shared[1:2], [5], prefix_cache=False)
        echoed, = _submit_together(eng, shared[1:2], [5], echo=True, logprobs=0)
        hits.append(eng.metrics.prefix_hit_tokens)
        pressed = _submit_together(eng, distinct, [20, 20, 20])  # 21 pages on 12: evictions, preemptions
        hits.append(eng.metrics.prefix_hit_tokens)
        evicted, = _submit_together(eng, shared[:1], [5])
        hits.append(eng.metrics.prefix_hit_tokens)
    finally:
        eng.shutdown()
    held, pages = max((s for sink in together for s in sink.snapshots), key=lambda s: len(s[1]))
    assert len(pages) == 3 and all(p[:4] == published for p in pages), "the prefix's pages, shared"
    assert held == 4 + sum(len(p) - 4 for p in pages) < sum(len(p) for p in pages)
    reused = np.diff(hits).tolist()
    assert reused[:2] == [3 * 2 * CHUNK, 0], "each reuses the prefix's 2 chunks; opted out and echo none"
    assert reused[2] > 0 and eng.metrics.preemptions, "a resumed request reuses its own published pages"
    assert reused[3] == 0, "the prefix's pages were evicted for the distinct prompts"
    assert runner.cache_tokens_used == 0 and (runner.table == -1).all()
    answers = [first] + together + [opted_out, echoed] + pressed + [evicted]
    prompts = shared[:1] + shared + shared[1:2] * 2 + distinct + shared[:1]
    for i, (prompt, sink) in enumerate(zip(prompts, answers)):
        assert sink.tokens == _alone(model, prompt, len(sink.tokens)), f"request {i}"


def test_prefix_sharing_stays_off_with_mtp(model):
    runner = Runner(model, max_batch=4, max_seq_len=64, chunk=CHUNK, use_mtp=True, page_size=8, cache_tokens=96)
    with pytest.raises(ValueError, match="use_mtp off"):
        Engine(runner, load_tokenizer(), prefix_cache=1)


def test_generation_config_eos_ids_end_a_request(model, engine):
    """An id of generation_config.json's eos list (`Engine(eos_ids=...)`, which experiments.serve
    reads from the checkpoint) ends a request as the tokenizer's EOS does."""
    prompt = [5, 9, 2, 7]
    alone = np.asarray(generate(model, np.array([prompt], np.int32), 6))[0, len(prompt):].tolist()
    before, sink = engine.eos_ids, TokenSink()
    engine.eos_ids = before + (alone[2],)
    try:
        engine.submit(Request(prompt, SamplingParams(max_tokens=6), sink))
        assert sink.done.wait(300)
    finally:
        engine.eos_ids = before
    end = min(i for i, t in enumerate(alone) if t in before + (alone[2],))
    assert end <= 2 and sink.tokens == alone[:end + 1] and sink.reason == "stop"

"""Continuous batching: a fixed set of decode slots over the latent cache, filled from a bounded queue.

One engine thread loops: admit waiting requests into free slots, run one prefill chunk (the oldest
slot still reading its prompt), then one decode step over the decoding slots (a bucket of them, see
`runner`), then hand each request its
new token, text delta and, when it ends, its finish reason. A request ends at an EOS or one of its
stop token ids or stop strings ("stop"), or at max_tokens ("length"); `cancel` ends it at once and
frees its slot for the next admission. Requests never see each other: a slot's cache rows, position
and sampling parameters are its own (see `runner` and `sampling`).

A request with a grammar (`SamplingParams.grammar`, structured outputs) gets its own matcher
(`grammar.Matcher`), which gives its slot's bitmask rows before each step (along the MTP drafts, then
rolled back) and takes each kept token; it ends the request ("stop") when the grammar is complete. Near
the end of the request's budget the rows force the grammar's shortest completion, so a constrained
answer is complete (or, where no completion fits the budget, ends at "length").

A step that raises may have consumed the donated cache, so the engine resets: the requests in
slots end with an "error" event, the runner rebuilds its cache, and the queue is served again.
The cache is paged (`Runner`): a request is admitted into a free slot when the pages of what it has
fit the pool, and a decode step that finds the pages short preempts the newest request: its pages go
back and it is resumed later by prefilling its prompt and the tokens it has (vLLM's policy), so
its answer is the same. With `prefix_cache`, a prompt shares the pool's pages of its longest cached
prefix, in whole prefill chunks so that the chunks it still prefills are a cold prefill's, and
publishes its own prompt pages as they are written (`PagePool`: never copied, evicted least
recently used). `health()` says "ok",
"recovering" (during a reset) or "failed" (the reset itself raised; new requests are refused with
`EngineFailed`), with the last error. Text is detokenized (`TextStream`,
incremental) by the engine thread outside the lock, so `submit`, `cancel` and `/health` never wait on it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, NamedTuple

import numpy as np

from dsv3_jax.inference.sampling import RowSampling, TokenLogprobs
from dsv3_jax.serving.grammar import Grammars, Matcher
from dsv3_jax.serving.metrics import Metrics
from dsv3_jax.serving.penalties import Penalties, PenaltyTables
from dsv3_jax.serving.runner import Runner
from dsv3_jax.serving.textstream import TextStream

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    pass


class EngineFailed(RuntimeError):
    """The engine could not recover from a failed step; it serves nothing more."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = all tokens
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely (<= 20)
    echo: bool = False  # report the prompt's log-probabilities (on the first event; needs logprobs)
    penalties: Penalties = Penalties()  # presence / frequency / repetition, logit_bias, min_tokens
    prefix_cache: bool = True  # False: the prompt neither reuses nor shares cached prefix pages (echo never reuses)
    include_stop_str_in_output: bool = False  # the stop string, or the stop token's text, ends the text
    skip_special_tokens: bool = True  # special tokens are left out of the text
    grammar: str | None = None  # llguidance grammar string (`grammar.request_grammar`): the output follows it


# One token's log-probability and the most likely alternatives: (logprob, [(token id, logprob), ...]).
Logprob = tuple[float, list[tuple[int, float]]]


class Event(NamedTuple):
    """What a request receives after each of its steps (finish_reason set on the last one)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error" | None
    completion_tokens: int  # generated so far
    logprobs: list[Logprob] | None = None  # one per token_ids entry, when the request asked for logprobs
    prompt_logprobs: list[Logprob | None] | None = None  # echo: one per prompt token (the first None), first event


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]  # called from the engine thread
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    generated: list[int] = dataclasses.field(default_factory=list)
    stream: TextStream | None = None
    chunks: list = dataclasses.field(default_factory=list)  # prefill chunks still to run
    prompt_logprobs: list = dataclasses.field(default_factory=list)  # echo: gathered chunk by chunk
    matcher: Matcher | None = None  # its place in params.grammar
    done: bool = False


class Engine:
    """`prefix_cache`: prompts share the pages of their common prefixes (the pool's free pages
    bounding them). `eos_ids`: end-of-sequence ids beyond the tokenizer's own (generation_config.json's)."""

    def __init__(self, runner: Runner, tokenizer, *, max_queue: int = 64, prefix_cache: bool = False,
                 eos_ids: tuple[int, ...] = ()):
        if prefix_cache and runner.drafts:
            raise ValueError("prefix_cache needs use_mtp off (the MTP entry at a shared granule's end depends on "
                             "the token after it)")
        self.runner, self.tokenizer, self.max_queue = runner, tokenizer, max_queue
        # ids that end a request unless it sets ignore_eos: the tokenizer's EOS and any that the
        # checkpoint's generation_config.json adds
        self.eos_ids = tuple(dict.fromkeys((tokenizer.eos_id, *eos_ids)))
        self.share_pages = bool(prefix_cache)
        self.grammars = Grammars(tokenizer, runner.config.vocab_size)
        b = runner.max_batch
        self.slots: list[Request | None] = [None] * b
        self.positions = np.zeros(b, np.int32)  # decoding: position of next_tokens[:, 0]; else the frontier
        self.next_tokens = np.zeros((b, 1 + runner.drafts), np.int32)  # last token, then MTP drafts
        self.sampling = RowSampling.greedy(b, runner.penalty_width)
        self.penalties = PenaltyTables(self.sampling)  # writes into self.sampling's tables
        self.waiting: collections.deque[Request] = collections.deque()
        self.cond = threading.Condition()
        self.metrics = Metrics(num_slots=b, expert_cache=runner.offload and runner.offload.stats)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.state, self.last_error, self.resets = "ok", None, 0  # see health()

    # --- called from any thread ---------------------------------------------------------------

    def submit(self, request: Request) -> Request:
        """Queues the request; a grammar that does not compile raises `grammar.GrammarError`."""
        if request.params.grammar is not None:
            request.matcher = self.grammars.matcher(request.params.grammar)
        with self.cond:
            if self.state == "failed":
                raise EngineFailed(f"the engine failed and could not recover: {self.last_error}")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry later")
            p = request.params
            request.stream = TextStream(self.tokenizer, list(p.stop), p.include_stop_str_in_output,
                                        p.skip_special_tokens)
            self.waiting.append(request)
            self.metrics.requests_received += 1
            self.cond.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Ends the request now: out of the queue, or its slot freed for the next admission."""
        with self.cond:
            if request.done:
                return
            if request in self.waiting:
                self.waiting.remove(request)
            for slot, r in enumerate(self.slots):
                if r is request:
                    self._free(slot)
            self._finish(request, "cancelled", emit=False)

    def health(self) -> dict:
        """{"status": "ok" | "recovering" | "failed", "last_error": the last failed step's error or None,
        "resets": resets so far, "slots_in_use": slots holding a request, "queue_length": requests waiting,
        "cache_tokens_used": pages held (shared ones once), "cache_tokens_total": the pool}."""
        with self.cond:
            return {"status": self.state, "last_error": self.last_error, "resets": self.resets,
                    "slots_in_use": sum(r is not None for r in self.slots), "queue_length": len(self.waiting),
                    "cache_tokens_used": self.runner.cache_tokens_used, "cache_tokens_total": self.runner.cache_tokens}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dsv3-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify()
        if self._thread is not None:
            self._thread.join()

    # --- the engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self._stop and not self.waiting and all(r is None for r in self.slots):
                    self.cond.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # a bug must not take the server down: fail the requests it touched
                log.exception("engine step failed")
                self._reset(f"{type(e).__name__}: {e}")

    def _reset(self, reason: str) -> None:
        """Ends the requests in slots with an error and rebuilds the cache and its pool, shared prefix
        pages included (the step may have consumed it: nothing from before is trusted)."""
        with self.cond:
            self.state, self.last_error, self.resets = "recovering", reason, self.resets + 1
            for slot, r in enumerate(self.slots):
                if r is not None:
                    self._free(slot)
                    self._finish(r, "error")
        try:
            self.runner.reset()
        except Exception as e:
            log.exception("engine reset failed")
            with self.cond:
                self.state, self.last_error = "failed", f"{reason}; then the reset failed: {type(e).__name__}: {e}"
                while self.waiting:
                    self._finish(self.waiting.popleft(), "error")
            return
        with self.cond:
            self.state = "ok"

    def step(self) -> None:
        """Admission, one prefill chunk, one decode step."""
        with self.cond:
            self._admit()
            prefilling = [r for r in self.slots if r is not None and r.chunks]
            request = min(prefilling, key=lambda r: r.arrival) if prefilling else None
            slot = self.slots.index(request) if request is not None else -1
            sampling = RowSampling(*(a.copy() for a in self.sampling))
        if request is not None:
            self._prefill(slot, request, sampling)
        with self.cond:
            self._reserve()
            active = np.array([r is not None and not r.chunks for r in self.slots])
            positions, tokens = self.positions.copy(), self.next_tokens.copy()
            sampling = RowSampling(*(a.copy() for a in self.sampling))
            constrained = {slot: (r.matcher, self._budget(r)) for slot, r in enumerate(self.slots)
                           if active[slot] and r.matcher}
        if active.any():
            start = time.perf_counter()
            bitmask = self.runner.free_bitmask.copy() if constrained else None
            drafted = {slot: m.fill_drafts(tokens[slot, 1:], bitmask[slot], budget)
                       for slot, (m, budget) in constrained.items()}
            result = self.runner.decode(tokens, positions, active, sampling, bitmask)
            for slot, (m, _) in constrained.items():  # the kept tokens advance it in _detokenize
                m.rollback(drafted[slot])
            self.metrics.decode_step(time.perf_counter() - start, int(active.sum()), result.expert_counts,
                                     drafts=self.runner.drafts, accepted=int(result.accepted[active].sum()))
            with self.cond:
                requests = {slot: self.slots[slot] for slot in np.flatnonzero(active) if self.slots[slot] is not None}
                for slot in requests:  # those not cancelled during the step
                    self.positions[slot] += int(result.accepted[slot]) + 1
                    self.next_tokens[slot] = result.next_tokens[slot]
            for slot, r in requests.items():
                n = int(result.accepted[slot]) + 1
                logprobs = _logprobs(TokenLogprobs(*(a[slot] for a in result.logprobs)), r.params.logprobs, n)
                self._accept(slot, r, result.emitted[slot, :n].tolist(), logprobs)

    def _reserve(self) -> None:
        """Pages for every decoding slot's next step (its fed token and drafts), preempting
        the newest request while they are short (vLLM's policy): its pages go back and it waits at
        the head of the queue, to be prefilled again from its prompt and the tokens it has."""
        for slot, r in enumerate(self.slots):
            if r is None or r.chunks:
                continue
            while not self.runner.grow(slot, r, int(self.positions[slot]) + 1 + self.runner.drafts):
                victim = self.runner.newest(slot)
                self._free(self.slots.index(victim))
                self.waiting.appendleft(victim)
                victim.prompt_logprobs = []  # its prefill starts over
                self.metrics.preemptions += 1
                if victim is r:
                    break

    def _admit(self) -> None:
        """Fills free slots, lowest first, while the head of the queue's pages fit its slot's shard."""
        for slot, r in enumerate(self.slots):
            if r is None and self.waiting:
                request = self.waiting[0]
                p = request.params
                reuse = p.prefix_cache and not p.echo  # echo scores every prompt token
                tokens = request.prompt + request.generated  # a preempted request resumes from what it has
                cached = self.runner.admit(slot, request, tokens, share=self.share_pages and reuse)
                if cached is None:
                    continue  # first come, first served: the pages (of this slot's shard) free up
                self.waiting.popleft()
                self.slots[slot] = request
                request.chunks = [c for c in self.runner.chunks(len(tokens)) if c[0] >= cached]
                self.metrics.prefix_hit(cached)
                self.sampling.set_row(slot, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)
                self.penalties.start(slot, request.prompt, p.penalties)
                self.penalties.observe(slot, request.generated)
                self.positions[slot] = cached

    def _prefill(self, slot: int, request: Request, sampling: RowSampling) -> None:
        start, valid, _ = request.chunks[0]
        bitmask_G = None
        if request.matcher is not None:  # its first token follows the grammar
            bitmask_G = self.runner.free_bitmask[0, 0].copy()
            request.matcher.fill(bitmask_G[None], 0, self._budget(request))
        out = self.runner.prefill_chunk(slot, request.prompt + request.generated, start, sampling, bitmask_G)
        with self.cond:
            if self.slots[slot] is not request:  # cancelled meanwhile
                return
            request.chunks.pop(0)
            self.positions[slot] = start + valid
            if self.share_pages and request.params.prefix_cache:
                self.runner.publish(slot, request, start + valid)
            last = not request.chunks
            if request.params.echo:  # entry i scores prompt token start + i + 1 (the last one: the sampled token)
                request.prompt_logprobs += _logprobs(out.logprobs, request.params.logprobs, valid - last)
            if not last:
                return
            if not request.generated:  # not a resumed request
                self.metrics.first_token(time.perf_counter() - request.arrival, len(request.prompt))
            self.next_tokens[slot] = out.next_tokens
        self._accept(slot, request, [int(out.next_tokens[0])],
                     _logprobs(out.logprobs, request.params.logprobs, valid, first=valid - 1))

    def _accept(self, slot: int, request: Request, tokens: list[int], logprobs: list[Logprob] | None = None) -> None:
        """Gives the slot's request its new tokens (and their log-probabilities), in order, up to the
        first that ends it; then ends it (and frees the slot) when it is done. Detokenizes outside the
        lock: only this thread touches a request's `generated` and `stream`."""
        prompt_logprobs = [None] + request.prompt_logprobs if request.params.echo and not request.generated else None
        text, kept, reason = self._detokenize(request, tokens)
        with self.cond:
            if self.slots[slot] is not request:  # cancelled while detokenizing: it already ended
                return
            self.metrics.generated_tokens += len(kept)
            self.penalties.observe(slot, kept)
            if reason is not None:
                self._free(slot)
            logprobs = None if logprobs is None else logprobs[:len(kept)]
            request.sink(Event(text, kept, reason, len(request.generated), logprobs, prompt_logprobs))
            if reason is not None:
                self._finish(request, reason, emit=False)

    def _detokenize(self, request: Request, tokens: list[int]) -> tuple[str, list[int], str | None]:
        """-> (text delta, tokens kept, finish reason or None)."""
        p = request.params
        reason, text, kept = None, "", []
        if p.max_tokens == 0:  # echo only: the prompt's log-probabilities, no token
            tokens, reason = [], "length"
        for token in tokens:
            kept.append(token)
            request.generated.append(token)
            stop_token = token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)
            if not stop_token or p.include_stop_str_in_output:
                text += request.stream.push([token])
            if stop_token or request.stream.stopped:
                reason = "stop"
            if reason is None and request.matcher is not None and request.matcher.advance(token):
                reason = "stop"  # the grammar is complete
            if reason is None and len(request.generated) >= p.max_tokens:
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            text += request.stream.finish()
        return text, kept, reason

    def _budget(self, request: Request) -> int:
        """Tokens the request may still generate: its max_tokens, and the room its slot's context leaves."""
        used = len(request.generated)
        return min(request.params.max_tokens - used, self.runner.context - len(request.prompt) - used)

    def _free(self, slot: int) -> None:
        if self.slots[slot] is not None:
            self.runner.release(slot, self.slots[slot])
        self.slots[slot] = None
        self.positions[slot] = 0
        self.sampling.set_row(slot, temperature=0.0, top_k=0, top_p=1.0, seed=0)
        self.penalties.clear(slot)

    def _finish(self, request: Request, reason: str, emit: bool = True) -> None:
        request.done = True
        self.metrics.finished(reason)
        if emit:
            request.sink(Event("", [], reason, len(request.generated)))


def _logprobs(lp: TokenLogprobs, top: int | None, stop: int, first: int = 0) -> list[Logprob] | None:
    """Entries first .. stop - 1 of a step's log-probabilities (numpy), each with its `top` alternatives."""
    if top is None:
        return None
    return [(float(lp.chosen[i]), list(zip(lp.top_ids[i, :top].tolist(), lp.top[i, :top].tolist())))
            for i in range(first, stop)]

"""Server counters and their Prometheus text exposition (format 0.0.4).

The engine thread updates them; `/metrics` renders them with the live gauges (queue length, slots
in use) passed in. Expert load is the share of the decoded tokens each routed expert received, per
MoE layer, counted from the decode steps' router statistics (active slots only).
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import psutil

WINDOW_SECONDS = 10.0  # generated tokens/s is measured over this trailing window


class Metrics:
    def __init__(self, num_slots: int, expert_cache=None):
        self.num_slots = num_slots
        self.expert_cache = expert_cache  # offloaded experts: the cache's `expert_cache.CacheStats`, else None
        self.requests_received = self.generated_tokens = self.prompt_tokens = self.prefix_hit_tokens = 0
        self.ttft_count = self.decode_steps = self.proposed_drafts = self.accepted_drafts = self.preemptions = 0
        self.ttft_sum = self.decode_seconds = 0.0
        self.finished_by_reason: collections.Counter = collections.Counter()
        self.responses_by_code: collections.Counter = collections.Counter()
        self.expert_counts: np.ndarray | None = None  # float64 [L_moe, E]
        self._window: collections.deque = collections.deque()  # (time, tokens) of recent steps
        self._lock = threading.Lock()

    def decode_step(self, seconds: float, rows: int, expert_counts: np.ndarray | None, *, drafts: int = 0,
                    accepted: int = 0) -> None:
        """One decode step over `rows` active slots; with MTP, `accepted` of their `drafts` each were kept."""
        tokens = rows + accepted
        with self._lock:
            self.proposed_drafts += rows * drafts
            self.accepted_drafts += accepted
            self.decode_steps += 1
            self.decode_seconds += seconds
            now = time.monotonic()
            self._window.append((now, tokens))
            while self._window and self._window[0][0] < now - WINDOW_SECONDS:
                self._window.popleft()
            if expert_counts is not None:
                counts = expert_counts.astype(np.float64)
                self.expert_counts = counts if self.expert_counts is None else self.expert_counts + counts

    def prefix_hit(self, tokens: int) -> None:
        with self._lock:
            self.prefix_hit_tokens += tokens

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1
            self.prompt_tokens += prompt_tokens

    def finished(self, reason: str) -> None:
        with self._lock:
            self.finished_by_reason[reason] += 1

    def response(self, code: int) -> None:
        with self._lock:
            self.responses_by_code[code] += 1

    def tokens_per_second(self) -> float:
        with self._lock:
            now = time.monotonic()
            recent = [n for t, n in self._window if t >= now - WINDOW_SECONDS]
        return sum(recent) / WINDOW_SECONDS

    def render(self, *, queue_length: int, slots_in_use: int, first_moe_layer: int = 0,
               cache_tokens: tuple[int, int] | None = None) -> str:
        """The Prometheus text; `cache_tokens`: the page pool's (tokens held, tokens in all), None: left out."""
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.extend([f"# HELP dsv3_{name} {help_}", f"# TYPE dsv3_{name} {kind}"])
            lines.extend(f"dsv3_{name}{labels} {value:.10g}" for labels, value in samples)

        with self._lock:
            metric("requests_received_total", "counter", "Requests accepted into the queue.",
                   [("", self.requests_received)])
            metric("requests_finished_total", "counter", "Requests ended, by finish reason.",
                   [(f'{{reason="{r}"}}', n) for r, n in sorted(self.finished_by_reason.items())])
            metric("http_responses_total", "counter", "HTTP responses, by status code.",
                   [(f'{{code="{c}"}}', n) for c, n in sorted(self.responses_by_code.items())])
            metric("queue_length", "gauge", "Requests waiting for a slot.", [("", queue_length)])
            metric("slots_in_use", "gauge", "Decode slots holding a request.", [("", slots_in_use)])
            metric("slots_total", "gauge", "Decode slots (max_batch).", [("", self.num_slots)])
            metric("requests_running", "gauge", "Requests in a slot (prefilling or decoding).", [("", slots_in_use)])
            if cache_tokens is not None:
                metric("cache_tokens_used", "gauge", "Tokens of the paged cache's pages held by requests.",
                       [("", cache_tokens[0])])
                metric("cache_tokens_total", "gauge", "Tokens the paged cache's pool holds.", [("", cache_tokens[1])])
            metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", self.prompt_tokens)])
            metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens taken from shared prefix pages.",
                   [("", self.prefix_hit_tokens)])
            metric("generated_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
            metric("decode_steps_total", "counter", "Decode steps run.", [("", self.decode_steps)])
            metric("decode_step_seconds_total", "counter", "Time in decode steps.", [("", self.decode_seconds)])
            metric("time_to_first_token_seconds", "summary", "Arrival to first token.",
                   [("_sum", self.ttft_sum), ("_count", self.ttft_count)])
            metric("preemptions_total", "counter", "Requests preempted for cache pages (resumed by prefill).",
                   [("", self.preemptions)])
            metric("mtp_acceptance_rate", "gauge", "Accepted / proposed MTP drafts (0 without --use_mtp).",
                   [("", self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0)])
            if self.expert_counts is not None:
                share = self.expert_counts / np.maximum(self.expert_counts.sum(-1, keepdims=True), 1)
                metric("expert_load", "gauge", "Share of decoded tokens' routings per expert and MoE layer.",
                       [(f'{{layer="{first_moe_layer + l}",expert="{e}"}}', share[l, e])
                        for l in range(share.shape[0]) for e in range(share.shape[1])])
            if self.expert_cache is not None:
                self._render_expert_cache(metric)
        metric("generated_tokens_per_second", "gauge", f"Tokens generated over the last {WINDOW_SECONDS:g} s.",
               [("", self.tokens_per_second())])
        lines.extend(["# HELP process_resident_memory_bytes Resident memory of the server process.",
                      "# TYPE process_resident_memory_bytes gauge",
                      f"process_resident_memory_bytes {psutil.Process().memory_info().rss}"])
        return "\n".join(lines) + "\n"

    def _render_expert_cache(self, metric) -> None:
        st = self.expert_cache
        metric("expert_cache_lookups_total", "counter", "(MoE layer, expert) pairs a step's tokens chose, once a step.",
               [("", st.lookups)])
        metric("expert_cache_misses_total", "counter", "Of those, experts loaded from host memory on demand.",
               [("", st.misses)])
        metric("expert_cache_hit_rate", "gauge", "1 - misses / lookups of the offloaded experts' device cache.",
               [("", st.hit_rate)])
        metric("expert_cache_bytes_moved_total", "counter", "Expert weights copied to the device (misses, prefetches).",
               [("", st.bytes_moved)])
        metric("expert_cache_bytes_per_token", "gauge", "Expert bytes moved per generated token.",
               [("", st.bytes_moved / max(self.generated_tokens, 1))])
        metric("expert_cache_stall_seconds_total", "counter", "Time in step reruns after a miss and in expert loads.",
               [("", st.stall_seconds)])

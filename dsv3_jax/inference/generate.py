"""Autoregressive generation: a chunked prefill, then one compiled decode step reused for every token.

Output layout (ragged batches): prompts are right-padded, row b's prompt is prompts[b, :lengths[b]].
The result is int32 [B, T + max_new_tokens]; row b holds its prompt, then its generated tokens from
index lengths[b], then `pad_id`. A row stops after its first stop token (kept); later slots are
`pad_id`. Positions are 0 .. lengths[b] - 1 for the prompt, as in training.

Compilation: the cache length is a power-of-two bucket of T + max_new_tokens (+ drafts), at least
one prefill chunk, so the decode step compiles once per (batch, bucket, options) and the prefill
once per (batch, bucket) (its chunks are all one width: `prefill.plan`), whatever the prompt length;
both are reused across tokens and calls. `GenerateStats` counts the traces of each call.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, NamedTuple

import jax
import numpy as np
from flax import nnx

from dsv3_jax.inference import prefill, steps
from dsv3_jax.inference.cache import bucket_slots, init_cache, token_shards
from dsv3_jax.inference.page_pool import PagePool
from dsv3_jax.inference.sampling import SamplingConfig
from dsv3_jax.model.transformer import check_tokens


@dataclasses.dataclass
class GenerateStats:
    prefill_seconds: float = 0.0  # compile included on a first call
    first_step_seconds: float = 0.0  # the first decode step (compile included on a first call)
    decode_seconds: float = 0.0  # the decode steps after the first
    timed_tokens: int = 0  # tokens kept by those steps
    forwards: int = 0  # decode steps after the prefill (each one forward of the main model)
    generated_tokens: int = 0  # kept tokens, all rows
    row_steps: int = 0  # decode steps summed over the rows still generating
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    prompt_expert_counts: np.ndarray | None = None  # float32 [L_moe, E] routed prompt tokens per expert
    prefill_chunks: int = 0  # chunk steps the prompt took
    prefill_traces: int = 0  # prefill chunk steps traced (compiled) during this call
    decode_traces: int = 0  # decode steps traced during this call

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a row-step produced (before truncation at the end): its accepted drafts and one more."""
        return (self.row_steps + self.accepted_drafts) / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.timed_tokens / self.decode_seconds if self.decode_seconds else 0.0


class StepTokens(NamedTuple):
    """New tokens of one step: row b gained tokens[b, :counts[b]]."""

    tokens: np.ndarray  # int32 [B, K]
    counts: np.ndarray  # int32 [B]


def _validate(model, prompts, max_new_tokens, lengths, stop_tokens, use_mtp):
    cfg = model.config
    prompts = np.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be int token ids [batch, length] with length >= 1, got shape {prompts.shape}")
    b, t = prompts.shape
    lengths = np.full((b,), t, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if lengths.shape != (b,) or lengths.min() < 1 or lengths.max() > t:
        raise ValueError(f"lengths must be [batch={b}] ints in [1, {t}] (the padded prompt length), got {lengths}")
    valid = np.arange(t)[None] < lengths[:, None]
    check_tokens(np.where(valid, prompts, 0), cfg.vocab_size)  # padding may hold anything
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if t + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {t} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    bad = [s for s in stop_tokens if not 0 <= int(s) < cfg.vocab_size]
    if bad:
        raise ValueError(f"stop_tokens {bad} lie outside [0, vocab_size={cfg.vocab_size})")
    if use_mtp and model.mtp is None:
        raise ValueError("use_mtp=True needs a model with MTP modules (config num_mtp_layers >= 1)")
    return prompts.astype(np.int32), lengths


class Generation:
    """Generates up to `max_new_tokens` per row after int32 `prompts` [B, T], yielding StepTokens as
    they are produced; `output()` and `stats` once iteration has finished.

    temperature 0 is greedy; otherwise samples (top_k, top_p as in `sampling`) reproducibly for a
    `seed`. `lengths` [B] gives ragged (right-padded) prompt lengths. `use_mtp` drafts with the MTP
    modules and verifies in one step (same tokens as without when greedy; same distribution when
    sampling). `cache_dtype` is "float32", "bfloat16", "float8" or "int8" (default: the compute dtype).
    The prompt enters the cache in chunks of `prefill_chunk` tokens (a power of two; the last one
    padded, so a prompt shorter than a chunk costs a whole one). `param_shardings` (a pytree of
    shardings matching `nnx.state(model)`) and `cache_sharding` (one sharding for every cache array
    [L, B, S, ...]) place the weights and the cache for sharded decoding. `rows`: the rows asked for
    (default all); the later ones only pad the batch to a multiple of a mesh's token shards, and no
    statistic counts them. `offload`: an `expert_cache.ExpertOffload` of this model, whose device cache
    of routed experts the steps run through. `page_size`: a paged cache of pages of that many tokens
    (`PagePool`), each row holding pages for its own prompt and new tokens only, not the longest
    row's; the server's cache layout, same tokens. With a `cache_sharding` on a mesh the pool splits over
    its batch shards with the rows, each row holding pages of its own shard (`model.page_shards`).
    """

    def __init__(self, model, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, lengths=None, stop_tokens=(), use_mtp: bool = False,
                 pad_id: int = 0, cache_dtype: str | None = None, prefill_chunk: int = prefill.DEFAULT_CHUNK,
                 param_shardings=None, cache_sharding=None, rows: int | None = None, offload=None,
                 page_size: int | None = None):
        cfg = self.model_config = model.config
        self.prompts, self.lengths = _validate(model, prompts, max_new_tokens, lengths, stop_tokens, use_mtp)
        self.max_new_tokens, self.stop_tokens, self.pad_id = max_new_tokens, tuple(int(s) for s in stop_tokens), pad_id
        self.sampling = SamplingConfig(float(temperature), top_k, top_p)
        self.key = jax.random.key(seed)
        graphdef, state = nnx.split(model)
        self.state = state if param_shardings is None else jax.device_put(state, param_shardings)
        self.depths = cfg.num_mtp_layers if use_mtp else 0
        b, t = self.prompts.shape
        self.chunks = prefill.plan(t, prefill_chunk)
        slots = bucket_slots(max(t + max_new_tokens + self.depths, prefill.padded_end(t, prefill_chunk)))
        cache_dtype = cache_dtype or cfg.compute_dtype
        self.page_table = None  # int32 [B, M] of a paged cache, passed with the cache to every step
        if page_size is not None:
            shards = 1 if cache_sharding is None else token_shards(cache_sharding.mesh)
            cache, self.page_table = self._paged_cache(cache_dtype, use_mtp, page_size, slots, shards)
        else:
            cache = init_cache(cfg, b, slots, cache_dtype, with_mtp=use_mtp)
        self.cache = cache if cache_sharding is None else jax.device_put(cache, cache_sharding)
        self.steps = steps.compiled(graphdef, steps.StepOptions(use_mtp, self.sampling), cache_sharding)
        if offload is not None:  # an `expert_cache.ExpertOffload` installed on this model
            # a step's valid tokens: a prefill chunk's (at most the prompt's) over the rows, or a decode step's
            self.steps = offload.wrap(self.steps, b * max(min(prefill_chunk, t), 1 + self.depths))
        self.rows = b if rows is None else rows
        self.stats = GenerateStats()
        self._out = np.full((b, t + max_new_tokens), pad_id, np.int32)
        self._out[:, :t] = np.where(np.arange(t)[None] < self.lengths[:, None], self.prompts, pad_id)
        self._count = np.zeros((b,), np.int32)
        self._done = np.zeros((b,), bool)
        self._all_rows, self._all_active = np.arange(b, dtype=np.int32), np.ones((b,), bool)
        self._requested = np.arange(b) < self.rows

    def _paged_cache(self, cache_dtype: str, use_mtp: bool, page_size: int, slots: int, shards: int):
        """A pool of pages for every row's prompt, new tokens and drafts, and the rows' page table
        covering `slots` positions. On a mesh the rows and the pool split into `shards` equal blocks
        (`model.page_shards`), a row taking pages of its own block; each block holds a power of two
        of pages (calls of similar size share a compile), never more than its rows of `slots`."""
        b, extra = self.prompts.shape[0], self.max_new_tokens + self.depths
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 token, got {page_size}")
        if b % shards:
            raise ValueError(f"page_size on a mesh: the batch of {b} rows must split evenly over its {shards} batch "
                             f"shards (data x fsdp x expert), each holding the pages of its rows")
        m, rows_SxR = -(-slots // page_size), np.arange(b).reshape(shards, -1)
        need = int(np.max(np.sum(-(-(self.lengths[rows_SxR] + extra) // page_size), axis=1)))
        per_shard = min(1 << (need - 1).bit_length(), rows_SxR.shape[1] * m)
        table_BxM = np.full((b, m), -1, np.int32)
        for shard, rows in enumerate(rows_SxR):
            pool = PagePool(per_shard, page_size, first_page=shard * per_shard)
            for row in rows:
                pool.admit(row, self.prompts[row, :self.lengths[row]].tolist())
                if not pool.grow(row, extra):  # the pool is sized above for every row's pages
                    raise RuntimeError(f"page pool of {pool.num_pages} pages short for row {row}")
                pool.fill_row(table_BxM, row, row)
        return init_cache(self.model_config, shards * per_shard, page_size, cache_dtype, with_mtp=use_mtp), table_BxM

    def _cache(self):
        """The cache a step takes: with its page table (a host array), if paged."""
        return self.cache if self.page_table is None else self.cache._replace(page_table=self.page_table)

    def _keep(self, tokens_BxK: np.ndarray, n_BxK: np.ndarray) -> StepTokens:
        """Writes each active row's first n tokens, cut at max_new_tokens and after a stop token."""
        counts = np.zeros_like(self._count)
        for row in np.flatnonzero(~self._done):
            for tok in tokens_BxK[row, :min(n_BxK[row], self.max_new_tokens - self._count[row])]:
                self._out[row, self.lengths[row] + self._count[row]] = tok
                self._count[row] += 1
                counts[row] += 1
                if int(tok) in self.stop_tokens:
                    self._done[row] = True
                    break
            self._done[row] |= self._count[row] >= self.max_new_tokens
        self.stats.generated_tokens += int(counts[self._requested].sum())
        return StepTokens(tokens_BxK, counts)

    def _prefill(self) -> np.ndarray:
        """Runs the prompt through the cache chunk by chunk; returns the first decode step's tokens."""
        b = self.prompts.shape[0]
        carry = prefill.init_carry(self.model_config, b, self.depths)
        for start, width in self.chunks:
            window = prefill.window(self.prompts, start, width, self.depths)
            (carry, _), self.cache = self.steps.prefill(self.state, self._cache(), self._all_rows, window,
                                                        np.int32(start), self.lengths, carry, None, self.key)
        self.stats.prefill_chunks = len(self.chunks)
        if carry.expert_counts is not None:
            self.stats.prompt_expert_counts = np.asarray(carry.expert_counts)
        return np.concatenate([np.asarray(carry.first)[:, None], np.asarray(carry.drafts)], axis=1)

    def __iter__(self) -> Iterator[StepTokens]:
        traces_before = dict(self.steps.traces)
        start = time.perf_counter()
        tokens = self._prefill()
        self.stats.prefill_seconds = time.perf_counter() - start
        self.stats.prefill_traces = self.steps.traces["prefill"] - traces_before.get("prefill", 0)
        yield self._keep(tokens[:, :1], np.ones_like(self._count))
        positions = self.lengths.copy()
        while not self._done.all():
            active, start = ~self._done, time.perf_counter()
            out, self.cache = self.steps.decode(self.state, self._cache(), self._all_rows, tokens, positions,
                                                self._all_active, None, self.key, np.int32(self.stats.forwards + 1))
            self.stats.decode_traces = self.steps.traces["decode"] - traces_before.get("decode", 0)
            # next_tokens back on the host, as the prefill's were: a device array (committed) would be a new
            # input signature for the second step and compile the decode step again
            emitted, accepted, tokens = np.asarray(out.emitted), np.asarray(out.accepted), np.asarray(out.next_tokens)
            seconds = time.perf_counter() - start
            self.stats.forwards += 1
            counted = active & self._requested
            self.stats.row_steps += int(counted.sum())
            self.stats.proposed_drafts += int(counted.sum()) * (emitted.shape[1] - 1)
            self.stats.accepted_drafts += int(accepted[counted].sum())
            # finished rows stay in the batch but stop advancing, so their slots stay in the bucket
            positions = np.where(active, positions + accepted + 1, positions).astype(np.int32)
            kept = self._keep(emitted, accepted + 1)
            if self.stats.forwards == 1:  # holds the compile on a first call: timed apart
                self.stats.first_step_seconds = seconds
            else:
                self.stats.decode_seconds += seconds
                self.stats.timed_tokens += int(kept.counts[self._requested].sum())
            yield kept

    def output(self) -> np.ndarray:
        """int32 [B, T + max_new_tokens] in the layout of the module docstring."""
        return self._out


def generate(model, prompts, max_new_tokens: int, *, return_stats: bool = False, **options):
    """`Generation` run to the end (`options`: its keyword arguments). Returns int32
    [B, T + max_new_tokens] (layout in the module docstring) and, with `return_stats`, a
    GenerateStats (acceptance_rate, tokens_per_forward, timings).
    """
    gen = Generation(model, prompts, max_new_tokens, **options)
    for _ in gen:
        pass
    out = jax.device_put(gen.output())  # a transfer: jnp.asarray would compile a copy per prompt length
    return (out, gen.stats) if return_stats else out

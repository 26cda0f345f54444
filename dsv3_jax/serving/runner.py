"""The engine's only door into the model: a paged latent cache shared by `max_batch` slots, chunked
prefill of one prompt into one slot's pages, and one decode step over every slot at its own
position, optionally with MTP speculation (each slot feeds its last token and M drafts;
`inference.speculative.accept`).

Letters: B slots (max_batch), S context (max_seq_len), W chunk length, V vocab, L layers, E experts,
M drafts (MTP depths when speculating, else 0), K = 1 + M tokens fed per slot and step, P page size.

The steps are the inference core's (`dsv3_jax.inference.steps`: `prefill.prefill_chunk` and
`steps.decode_step`, the ones `generate()` runs), with per-row sampling, penalties and
log-probabilities switched on; prompts are cut into chunks by `dsv3_jax.inference.prefill.plan`, as
`generate()` cuts them. Each call's tokens attend to the cache positions before theirs and to
each other.

The cache is a pool of pages of P tokens (`PagePool`): a slot's request holds pages for the tokens
it has, not for the longest context, and a step reads and writes its rows through their rows of
the page table (`admit`, `grow`, `release`). Slots bound the requests in flight, pages the tokens
they hold. A page holds stale entries at positions its request has not reached; attention never
reads them (see `dsv3_jax.inference.cache`), so a freed page needs no clearing. Prompt prefixes are
shared as pages in granules of lcm(P, W) tokens (`admit(share=True)`, `publish`).

Decode buckets: a step runs only N rows, N the smallest of 1, 2, 4, ... max_batch that holds the
decoding slots (padded with distinct idle ones, whose page-table rows are empty), so a lone request
costs a batch-1 step, not a max_batch one.

Grammars (structured outputs): every step takes a token bitmask per row (`steps`; int32 [B, K, G],
G = ceil(V / 32)), all bits set for a free slot, so a constrained request joining the batch compiles
nothing; the engine fills the constrained slots' rows (`grammar.Matcher`).

Compilation: the decode step once per bucket N (`decode_buckets`); a prefill chunk once (`prefill.plan`:
every chunk `chunk` wide, the last one padded). Every function is pure in
(state, cache, ...) and donates the cache.

On a mesh (`mesh=`, the one the weights were loaded onto, `load_pretrained(mesh=...)`): the pool's
pages and the slots are split as the rules table splits a batch (`data` x `fsdp` x `expert`: slot b
in shard b % shards, one `PagePool` each, a request taking pages of its slot's shard, where its
attention runs; `dsv3_jax.model.page_shards`), every step is traced and run under `jax.set_mesh(mesh)`, so
the MoE layers exchange tokens with their experts' devices (`sharding/expert_parallel.py`) and XLA
splits MLA's heads as the weights are split (`tensor`), and every step returns the cache in the
sharding it came in (one compile per shape, as on one device). Expert parallelism splits a step's
tokens over the token axes (data x fsdp x expert), so decode buckets are multiples of that product
and a prefill chunk's width must be one too.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from dsv3_jax.inference import init_cache, prefill, steps
from dsv3_jax.inference.cache import CACHE_DTYPES, cache_sharding, token_shards  # noqa: F401 (re-exported)
from dsv3_jax.inference.page_pool import PagePool
from dsv3_jax.inference.sampling import RowSampling, TokenLogprobs
from dsv3_jax.serving.penalties import table_width


class PrefillResult(NamedTuple):
    next_tokens: np.ndarray  # int32 [K]: the sampled next token, then the MTP drafts that follow it
    logprobs: TokenLogprobs  # numpy [W] / [W, N]: entry i of the token after chunk position i (the prompt's
    # next token, or at the prompt's last position the sampled one); entries past the valid ones are padding


def decode_buckets(max_batch: int, multiple: int = 1) -> tuple[int, ...]:
    """Row counts a decode step compiles for: `multiple` times the powers of two below `max_batch`,
    then `max_batch` (a multiple of `multiple`)."""
    sizes = (multiple << i for i in range(max(max_batch // multiple - 1, 0).bit_length()))
    return tuple(n for n in sizes if n < max_batch) + (max_batch,)


def step_rows(active_B: np.ndarray, buckets: tuple[int, ...], shards: int = 1) -> np.ndarray:
    """int32 [N]: the slots a decode step runs, the active ones first, padded with idle ones to the
    smallest bucket N that holds them (distinct, so the scatter back writes each slot once). With
    `shards` (a mesh), block i of the N rows is shard i's (slots i, i + shards, ...): N / shards
    rows hold each shard's active slots, so a row reads the pages of its own shard."""
    by_shard = [np.arange(i, len(active_B), shards) for i in range(shards)]
    n = next(b for b in buckets if b // shards >= max(np.count_nonzero(active_B[s]) for s in by_shard))
    if n == len(active_B) and shards == 1:
        return np.arange(n, dtype=np.int32)
    return np.concatenate([np.concatenate([s[active_B[s]], s[~active_B[s]]])[:n // shards]
                           for s in by_shard]).astype(np.int32)


class Runner:
    """Owns the model state and the paged cache; the engine calls `admit`, `prefill_chunk`, `decode`,
    `grow` and `release`.

    `page_size`: tokens per page (default: the prefill `chunk`, so a shared prefix's granule,
    lcm(page_size, chunk), is one page and one chunk). `cache_tokens`: the pool, all requests
    together (default max_batch x max_seq_len in whole pages: each slot can hold its longest
    request, the memory one row of max_seq_len per slot takes)."""

    def __init__(self, model, *, max_batch: int, max_seq_len: int, cache_dtype: str | None = None,
                 chunk: int = 64, use_mtp: bool = False, mesh=None, rules=None, offload=None,
                 page_size: int | None = None, cache_tokens: int | None = None):
        cfg = model.config
        page_size = chunk if page_size is None else page_size
        if use_mtp and model.mtp is None:
            raise ValueError("use_mtp needs a model with MTP modules (config num_mtp_layers >= 1)")
        if not 2 <= max_seq_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len must lie in [2, max_position_embeddings={cfg.max_position_embeddings}], "
                             f"got {max_seq_len}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        prefill.check_chunk(chunk)
        shards = token_shards(mesh)
        if max_batch % shards or chunk % shards:
            raise ValueError(f"on this mesh a step's tokens are split over {shards} devices (data x fsdp x expert): "
                             f"max_batch={max_batch} and the prefill width chunk={chunk} "
                             f"must be multiples of {shards}")
        if cache_tokens is None and page_size >= 1:
            cache_tokens = max_batch * -(-max_seq_len // page_size) * page_size
        _check_pages(page_size, cache_tokens, max_seq_len, shards)
        self.page_size, self.cache_tokens, self.shards = page_size, cache_tokens - cache_tokens % page_size, shards
        self.config, self.max_batch, self.max_seq_len, self.chunk = cfg, max_batch, max_seq_len, chunk
        self.cache_dtype = cache_dtype or cfg.compute_dtype
        self.mesh, self.cache_sharding = mesh, cache_sharding(mesh, max_batch, rules)
        self.decode_buckets = decode_buckets(max_batch, shards)
        self.drafts = cfg.num_mtp_layers if use_mtp else 0
        self.context = max_seq_len - self.drafts  # prompt + max_tokens: the verify step writes M past the last
        self.penalty_width = table_width(self.context)  # columns of RowSampling's penalty tables
        self.free_bitmask = np.full((max_batch, 1 + self.drafts, -(-cfg.vocab_size // 32)), -1, np.int32)
        graphdef, self.state = nnx.split(model)
        self.reset()
        self.steps = steps.compiled(graphdef, steps.StepOptions(use_mtp, logprobs=True), self.cache_sharding)
        self.offload = offload  # an `expert_cache.ExpertOffload` of this model: the steps run through its cache
        if offload is not None:
            # a step's tokens: one row's prefill chunk, or every slot's decode step
            self.steps = offload.wrap(self.steps, max(chunk, max_batch * (1 + self.drafts)))

    def _on_mesh(self):
        """The context every step is traced and run in: the mesh (expert parallelism), if any."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def reset(self) -> None:
        """A new zero cache and an empty pool: after a failed step, whose donated cache may be gone."""
        # prefixes shared in whole prefill chunks: a reused prefix's pages hold a cold prefill's bits
        granule = math.lcm(self.page_size, self.chunk) // self.page_size
        pages = self.cache_tokens // self.page_size // self.shards  # per shard
        self.pools = [PagePool(pages, self.page_size, granule, first_page=i * pages) for i in range(self.shards)]
        self.table = np.full((self.max_batch, -(-self.max_seq_len // self.page_size)), -1, np.int32)
        cache = init_cache(self.config, pages * self.shards, self.page_size, self.cache_dtype, with_mtp=self.drafts > 0)
        # committed to a device (or placed on the mesh), as every step's output is: one compiled step for both
        self.cache = jax.device_put(cache, self.cache_sharding or jax.devices()[0])

    def _pool(self, slot: int) -> PagePool:
        """The pages of the slot's shard."""
        return self.pools[slot % self.shards]

    def admit(self, slot: int, rid, tokens: list[int], share: bool = False) -> int | None:
        """Pages for a prompt of `tokens` in the slot's table row, those of its longest cached
        prefix (in its shard) shared when `share`; -> the prompt tokens already cached, None when they
        do not fit."""
        if not self._pool(slot).can_admit(tokens, share):
            return None
        cached = self._pool(slot).admit(rid, tokens, share)
        self._pool(slot).fill_row(self.table, slot, rid)
        return cached

    def publish(self, slot: int, rid, written: int) -> None:
        """The request's first `written` positions are in its pages, its full prompt granules shareable."""
        self._pool(slot).publish(rid, written)

    def grow(self, slot: int, rid, end: int) -> bool:
        """Pages for the slot's positions before `end`; False, nothing changed, when too few are free."""
        more = end - self._pool(slot).requests[rid].tokens
        if more > 0 and not self._pool(slot).grow(rid, more):
            return False
        self._pool(slot).fill_row(self.table, slot, rid)
        return True

    def newest(self, slot: int):
        """The request to preempt when the slot's pages run short, the newest of its shard's."""
        return self._pool(slot).newest()

    def release(self, slot: int, rid) -> None:
        """The request's pages back to the pool, the slot's table row empty."""
        self._pool(slot).release(rid)
        self.table[slot] = -1

    @property
    def cache_tokens_used(self) -> int:
        """The tokens of the pages held (a shared page once)."""
        return sum(pool.held_pages for pool in self.pools) * self.page_size

    def _cache(self, rows_N: np.ndarray):
        """The cache a step over rows_N takes: with those rows' page table."""
        return self.cache._replace(page_table=self.table[rows_N])

    def chunks(self, length: int) -> list[tuple[int, int, int]]:
        """(start, valid, padded width) of each chunk of a `length`-token prompt."""
        return [(start, min(width, length - start), width) for start, width in prefill.plan(length, self.chunk)]

    def prefill_chunk(self, slot: int, prompt: np.ndarray, start: int, sampling: RowSampling,
                      bitmask_G: np.ndarray | None = None) -> PrefillResult:
        """Writes the prompt's chunk at `start` into the slot's pages (admitted to hold the prompt).
        Returns the sampled next token (kept by the caller only after the last chunk; drawn among
        those bitmask_G allows, None: any) with its MTP drafts, and the chunk's next-token
        log-probabilities."""
        bitmask_G = self.free_bitmask[0, 0] if bitmask_G is None else bitmask_G
        prompt = np.asarray(prompt, np.int32)[None]
        window = prefill.window(prompt, start, self.chunk, self.drafts)
        row = RowSampling(*(None if a is None else a[slot:slot + 1] for a in sampling))
        carry = prefill.init_carry(self.config, 1, self.drafts)
        with self._on_mesh():
            rows = np.array([slot], np.int32)
            out, self.cache = self.steps.prefill(self.state, self._cache(rows), rows, window,
                                                 np.int32(start), np.array([prompt.shape[1]], np.int32), carry, row,
                                                 None, bitmask_G[None])
        (carry, logprobs) = jax.device_get(out)
        return PrefillResult(np.concatenate([carry.first, carry.drafts[0]]), TokenLogprobs(*(a[0] for a in logprobs)))

    def decode(self, tokens_BxK: np.ndarray, positions_B: np.ndarray, active_B: np.ndarray,
               sampling: RowSampling, bitmask_BxKxG: np.ndarray | None = None) -> steps.StepOut:
        """One step: active slot b feeds tokens[b] (its last token, then its drafts) from positions[b],
        output i drawn among the tokens bitmask[b, i] allows (None: any). Numpy results, the rows of
        inactive slots zeros."""
        rows_N = step_rows(np.asarray(active_B, bool), self.decode_buckets, self.shards)
        picked = RowSampling(*(None if a is None else np.asarray(a)[rows_N] for a in sampling))
        bitmask = self.free_bitmask if bitmask_BxKxG is None else bitmask_BxKxG
        out = self._step(rows_N, np.asarray(tokens_BxK, np.int32)[rows_N], np.asarray(positions_B, np.int32)[rows_N],
                         np.asarray(active_B, bool)[rows_N], picked, bitmask[rows_N])
        emitted_N, accepted_N, nxt_N, counts, logprobs_N = jax.device_get(tuple(out))
        emitted, accepted, nxt, *logprobs = (_scatter_rows(a, rows_N, self.max_batch)
                                             for a in (emitted_N, accepted_N, nxt_N, *logprobs_N))
        return steps.StepOut(emitted, accepted, nxt, counts, TokenLogprobs(*logprobs))

    def _step(self, rows_N, tokens_NxK, positions_N, active_N, sampling, bitmask_NxKxG):
        """The compiled decode step over rows_N (host arrays in, as warm-up passes them: no other compile)."""
        with self._on_mesh():
            out, self.cache = self.steps.decode(self.state, self._cache(rows_N), rows_N, tokens_NxK, positions_N,
                                                active_N, sampling, None, None, bitmask_NxKxG)
        return out

    def warm_up(self) -> None:
        """Compiles every prefill width and decode bucket (on idle slots: their rows hold nothing yet)."""
        b = self.max_batch
        greedy = RowSampling.greedy(b, self.penalty_width)

        def compile_steps():
            self.prefill_chunk(0, np.zeros(self.chunk, np.int32), 0, greedy)
            for n in self.decode_buckets:  # n active rows pick bucket n; their mask is switched off below
                self._step(step_rows(np.arange(b) < n, self.decode_buckets, self.shards),
                           np.zeros((n, 1 + self.drafts), np.int32),
                           np.zeros(n, np.int32), np.zeros(n, bool), RowSampling.greedy(n, self.penalty_width),
                           self.free_bitmask[:n])
        if self.offload is not None:
            self.offload.warm_up(compile_steps)  # at each expert slot count a step may grow to
        else:
            compile_steps()


def _check_pages(page_size: int, cache_tokens: int, max_seq_len: int, shards: int) -> None:
    """A paged cache's sizes: whole pages, the same number in each of the mesh's batch shards, and
    each shard able to hold one request of max_seq_len."""
    pages = cache_tokens // page_size if page_size >= 1 else 0
    if page_size < 1 or pages % shards or pages // shards < -(-max_seq_len // page_size):
        raise ValueError(f"a paged cache (--page_size={page_size}, --max_cache_tokens={cache_tokens}) needs pages of "
                         f">= 1 token, a number of them the mesh's {shards} batch shards (data x fsdp x expert) "
                         f"divide, and in each shard the pages of one request of --max_seq_len={max_seq_len}")


def _scatter_rows(a_NxX: np.ndarray, rows_N: np.ndarray, batch: int) -> np.ndarray:
    """[batch, ...] zeros with a_NxX's rows at rows_N: a bucket's results in their slots."""
    out = np.zeros((batch, *a_NxX.shape[1:]), a_NxX.dtype)
    out[rows_N] = a_NxX
    return out

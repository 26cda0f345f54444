"""The host-side bookkeeping of a paged latent cache: which pages of the pool each request holds.

The device reads a pool of N pages of K tokens through a page table [B, M] (`attend(page_table=)`,
`pallas_kernels.mla_decode`): row b's slot s lives in page `table[b, s // K]`, -1 where unused. This
pool hands out those page ids, so a request holds memory for the tokens it has, not for the longest
context, and requests are admitted by free pages rather than free slots. When a step needs pages
that are not there, `grow` says so and changes nothing; the caller then preempts the newest request
(`newest`, vLLM's policy): `release` returns its pages, and it is admitted again later, recomputing
its prefill.

Prefixes are shared as pages, never copied, in granules of `granule` pages (G tokens): granule g of
a prompt is keyed by the hash chain over the prompt's tokens up to its end (`block_keys`), and once
the caller says it is written (`publish`) a later prompt with the same tokens reuses its pages;
reference counts say how many requests hold each. A page is shared only as part of a whole granule
of the prompt and a request writes only past its shared granules, so a shared page is written once
and copy-on-write is never needed. With G a multiple of the prefill chunk (the server's
lcm(page_size, chunk)), a shared granule's pages were written by whole prefill chunks over the
same tokens, so a request that reuses them prefills the rest in the chunks a cold prefill runs and
gets the same bits. A keyed page that no request holds stays cached for reuse and is evicted least
recently used, only when the free list is empty. A prompt of T tokens reuses at most its first
(T - 1) // G granules: its last token is always prefilled, since its logits give the first
generated token.

`generate(page_size=)` reserves every row's pages up front; the serving engine admits, grows,
preempts, publishes and releases as its requests come and go.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np


def block_keys(prompt: list[int], width: int, blocks: int) -> list[bytes]:
    """Keys of the prompt's first `blocks` blocks of `width` tokens (each names its whole prefix)."""
    keys, key = [], b""
    tokens = np.asarray(prompt, np.int64)
    for k in range(blocks):
        key = hashlib.sha256(key + tokens[k * width:(k + 1) * width].tobytes()).digest()
        keys.append(key)
    return keys


def fitting_tokens(memory_stats: dict | None, token_bytes: int, fraction: float) -> int | None:
    """Cache tokens of `token_bytes` each that fit in `fraction` of a device's memory beside what it
    holds already (the weights), from `jax.Device.memory_stats()` (vLLM's --gpu-memory-utilization);
    None where the device reports no memory limit (CPU: memory_stats() is None)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the cache memory fraction must lie in (0, 1], got {fraction}")
    if not memory_stats or "bytes_limit" not in memory_stats:
        return None
    free = int(fraction * memory_stats["bytes_limit"]) - memory_stats.get("bytes_in_use", 0)
    return max(free, 0) // token_bytes


@dataclasses.dataclass
class _Request:
    pages: list[int]  # page j holds the request's slots [j K, (j + 1) K)
    tokens: int  # slots reserved
    keys: list[bytes]  # keys of the prompt's whole granules
    published: int = 0  # whole prompt granules offered for sharing so far


class PagePool:
    """`num_pages` pages of `page_size` tokens: a free list, per-request page lists, reference counts
    and an LRU cache of keyed pages no request holds. free + held + cached == num_pages always.
    Prefixes are shared in granules of `granule` pages. A page's key is (its granule's key, its
    place in the granule). `first_page`: the pool-wide id of this pool's page 0, where the device
    pool holds several such blocks (one per batch shard of a mesh); page tables hold pool-wide ids."""

    def __init__(self, num_pages: int, page_size: int, granule: int = 1, first_page: int = 0):
        if num_pages < 1 or page_size < 1 or granule < 1:
            raise ValueError(f"a page pool needs num_pages, page_size and granule >= 1, got {num_pages=}, "
                             f"{page_size=}, {granule=}")
        self.num_pages, self.page_size, self.granule, self.first_page = num_pages, page_size, granule, first_page
        self.free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self.refs_N = np.zeros(num_pages, np.int32)  # requests holding each page
        self.page_of: dict[tuple[bytes, int], int] = {}  # key -> page, for every keyed page, held or cached
        self.key_of: dict[int, tuple[bytes, int]] = {}
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recent first
        self.requests: dict[object, _Request] = {}  # in admission order

    @property
    def held_pages(self) -> int:
        """Pages some request holds, a shared page counted once (bytes = this x one page's bytes)."""
        return int(np.count_nonzero(self.refs_N))

    @property
    def available(self) -> int:
        """Pages a request can take: the free ones and the cached ones it may evict."""
        return len(self.free) + len(self.cached)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _request(self, rid) -> _Request:
        if rid not in self.requests:
            raise KeyError(f"request {rid!r} holds no pages in the pool (never admitted, or released)")
        return self.requests[rid]

    def _granule_keys(self, prompt: list[int], granules: int) -> list[bytes]:
        return block_keys(prompt, self.granule * self.page_size, granules)

    def _shared_prefix(self, prompt: list[int]) -> list[int]:
        """The keyed pages of the prompt's longest cached run of whole granules, at most (T - 1) // G."""
        found = []
        for key in self._granule_keys(prompt, (len(prompt) - 1) // (self.granule * self.page_size)):
            pages = [self.page_of.get((key, i)) for i in range(self.granule)]
            if None in pages:
                break
            found += pages
        return found

    def _need(self, prompt: list[int], share: bool) -> tuple[list[int], int]:
        """(shared prefix pages, pages beyond them) a prompt needs; raises on an empty prompt."""
        if len(prompt) < 1:
            raise ValueError("a request needs a prompt of >= 1 token, got an empty one")
        shared = self._shared_prefix(prompt) if share else []
        return shared, self._pages_for(len(prompt)) - len(shared)

    def can_admit(self, prompt: list[int], share: bool = True) -> bool:
        """Whether the prompt's pages fit: those beyond its shared prefix (none unless `share`), out of
        the available pages less the cached ones the prefix itself would take back."""
        shared, new = self._need(prompt, share)
        return new <= self.available - sum(p in self.cached for p in shared)

    def admit(self, rid, prompt: list[int], share: bool = True) -> int:
        """Reserves pages for the prompt's tokens under the id `rid`, reusing the pages of its longest
        cached prefix when `share`. -> the number of prompt tokens already in the cache (prefill
        starts there: a multiple of G)."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is admitted already")
        if not self.can_admit(prompt, share):
            raise ValueError(f"request {rid!r} of {len(prompt)} tokens needs more pages than the "
                             f"{self.available} available: check can_admit first, or preempt")
        shared, new = self._need(prompt, share)
        for page in shared:
            self.cached.pop(page, None)
            self.refs_N[page] += 1
        keys = self._granule_keys(prompt, len(prompt) // (self.granule * self.page_size))
        self.requests[rid] = _Request(shared + [self._take() for _ in range(new)], len(prompt), keys,
                                      published=len(shared) // self.granule)
        return len(shared) * self.page_size

    def _take(self) -> int:
        """A page off the free list, or else the least recently used cached page, its key dropped."""
        if self.free:
            page = self.free.pop()
        else:
            page, _ = self.cached.popitem(last=False)
            del self.page_of[self.key_of.pop(page)]
        self.refs_N[page] = 1
        return page

    def grow(self, rid, tokens: int) -> bool:
        """Reserves `tokens` more slots for the request (a decode or prefill step's). False, with
        nothing changed, when the pages are short: preempt `newest()` and try again."""
        if tokens < 1:
            raise ValueError(f"grow needs tokens >= 1, got {tokens}")
        request = self._request(rid)
        new = self._pages_for(request.tokens + tokens) - len(request.pages)
        if new > self.available:
            return False
        request.pages += [self._take() for _ in range(new)]
        request.tokens += tokens
        return True

    def publish(self, rid, written: int) -> None:
        """The request's first `written` slots are in its pages now: the pages of its whole prompt
        granules among them become shareable (a key another page has already keeps that page, this
        one stays private)."""
        request = self._request(rid)
        end = min(written // (self.granule * self.page_size), len(request.keys))
        for g in range(request.published, end):
            for i in range(self.granule):
                key, page = (request.keys[g], i), request.pages[g * self.granule + i]
                if key not in self.page_of:
                    self.page_of[key], self.key_of[page] = page, key
        request.published = max(request.published, end)

    def newest(self):
        """The id of the most recently admitted request still holding pages (the one to preempt)."""
        if not self.requests:
            raise ValueError("no request holds pages: nothing to preempt")
        return next(reversed(self.requests))

    def release(self, rid) -> None:
        """Gives back a finished or preempted request's pages: a page no one holds any more returns
        to the free list, or, when keyed, to the cache as most recent (its last pages first, so they
        are evicted before the prefix pages that lead to them)."""
        for page in reversed(self._request(rid).pages):
            self.refs_N[page] -= 1
            if self.refs_N[page] == 0:
                if page in self.key_of:
                    self.cached[page] = None
                else:
                    self.free.append(page)
        del self.requests[rid]

    def fill_row(self, table_BxM: np.ndarray, b: int, rid) -> None:
        """Writes the request's pages into row b of an int32 page table, as pool-wide ids, -1 past them."""
        pages = self._request(rid).pages
        if len(pages) > table_BxM.shape[1]:
            raise ValueError(f"request {rid!r} holds {len(pages)} pages, more than the page table's "
                             f"{table_BxM.shape[1]} columns")
        table_BxM[b] = -1
        table_BxM[b, :len(pages)] = np.asarray(pages, np.int32) + self.first_page

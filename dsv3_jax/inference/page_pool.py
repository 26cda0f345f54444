"""The host-side bookkeeping of a paged latent cache: which pages of the pool each request holds.

The device reads a pool of N pages of K tokens through a page table [B, M] (`attend(page_table=)`,
`pallas_kernels.mla_decode`): row b's slot s lives in page `table[b, s // K]`, -1 where unused. This
pool hands out those page ids, so a request holds memory for the tokens it has, not for the longest
context, and requests are admitted by free pages rather than free slots. When a step needs pages
that are not there, `grow` says so and changes nothing; the caller then preempts the newest request
(`newest`, vLLM's policy): `release` returns its pages, and it is admitted again later, recomputing
its prefill.

Prefixes are shared as pages, never copied. A full page of a prompt is keyed by the hash chain over
the prompt's tokens up to its end (`block_keys`, as the prefix cache's blocks), once the caller says
it is written (`publish`). A later prompt with the same tokens reuses the page: reference counts
say how many requests hold it. Only full pages are shared and a request writes only past its shared
pages, so a shared page is written once and copy-on-write is never needed. A keyed page that no
request holds stays cached for reuse and is evicted least recently used, only when the free list is
empty. A prompt of T tokens reuses at most (T - 1) // K pages: its last token is always prefilled,
since its logits give the first generated token.

`generate(page_size=)` reserves every row's pages up front; the serving engine admits, grows,
preempts and releases as its requests come and go (prompt pages not yet published there).
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


@dataclasses.dataclass
class _Request:
    pages: list[int]  # page j holds the request's slots [j K, (j + 1) K)
    tokens: int  # slots reserved
    keys: list[bytes]  # keys of the prompt's full pages
    published: int = 0  # full prompt pages offered for sharing so far


class PagePool:
    """`num_pages` pages of `page_size` tokens: a free list, per-request page lists, reference counts
    and an LRU cache of keyed pages no request holds. free + held + cached == num_pages always."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs num_pages >= 1 and page_size >= 1, got {num_pages=}, {page_size=}")
        self.num_pages, self.page_size = num_pages, page_size
        self.free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self.refs_N = np.zeros(num_pages, np.int32)  # requests holding each page
        self.page_of: dict[bytes, int] = {}  # key -> page, for every keyed page, held or cached
        self.key_of: dict[int, bytes] = {}
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

    def _shared_prefix(self, prompt: list[int]) -> list[int]:
        """The keyed pages of the prompt's longest cached prefix, at most (T - 1) // K of them."""
        found = []
        for key in block_keys(prompt, self.page_size, (len(prompt) - 1) // self.page_size):
            if key not in self.page_of:
                break
            found.append(self.page_of[key])
        return found

    def _need(self, prompt: list[int]) -> tuple[list[int], int]:
        """(shared prefix pages, pages beyond them) a prompt needs; raises on an empty prompt."""
        if len(prompt) < 1:
            raise ValueError("a request needs a prompt of >= 1 token, got an empty one")
        shared = self._shared_prefix(prompt)
        return shared, self._pages_for(len(prompt)) - len(shared)

    def can_admit(self, prompt: list[int]) -> bool:
        """Whether the prompt's pages fit: those beyond its shared prefix, out of the available pages
        less the cached ones the prefix itself would take back."""
        shared, new = self._need(prompt)
        return new <= self.available - sum(p in self.cached for p in shared)

    def admit(self, rid, prompt: list[int]) -> int:
        """Reserves pages for the prompt's tokens under the id `rid`, reusing its shared prefix pages.
        -> the number of prompt tokens already in the cache (prefill starts there)."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is admitted already")
        if not self.can_admit(prompt):
            raise ValueError(f"request {rid!r} of {len(prompt)} tokens needs more pages than the "
                             f"{self.available} available: check can_admit first, or preempt")
        shared, new = self._need(prompt)
        for page in shared:
            self.cached.pop(page, None)
            self.refs_N[page] += 1
        keys = block_keys(prompt, self.page_size, len(prompt) // self.page_size)
        self.requests[rid] = _Request(shared + [self._take() for _ in range(new)], len(prompt), keys,
                                      published=len(shared))
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
        """The request's first `written` slots are in its pages now: its full prompt pages among them
        become shareable (a key another page has already keeps that page, this one stays private)."""
        request = self._request(rid)
        end = min(written // self.page_size, len(request.keys))
        for j in range(request.published, end):
            if request.keys[j] not in self.page_of:
                self.page_of[request.keys[j]] = request.pages[j]
                self.key_of[request.pages[j]] = request.keys[j]
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
        """Writes the request's pages into row b of an int32 page table, -1 past them."""
        pages = self._request(rid).pages
        if len(pages) > table_BxM.shape[1]:
            raise ValueError(f"request {rid!r} holds {len(pages)} pages, more than the page table's "
                             f"{table_BxM.shape[1]} columns")
        table_BxM[b] = -1
        table_BxM[b, :len(pages)] = pages

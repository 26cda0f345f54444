"""The page pool's bookkeeping against an independent model: each request's set of pages and the
reference counts recounted from scratch, sharing checked on the prompts' tokens (not their hashes)."""

import random

import numpy as np
import pytest

from dsv3_jax.inference.page_pool import PagePool, fitting_tokens

K = 4  # tokens a page


def _check(pool: PagePool, model: dict, prompts: dict):
    """The invariants after every step; model = {rid: tokens reserved}."""
    held = {rid: pool.requests[rid].pages for rid in model}
    assert set(pool.requests) == set(model)
    refs = np.zeros(pool.num_pages, np.int64)
    for rid, pages in held.items():
        assert len(pages) == -(-model[rid] // K), rid  # pages for exactly the reserved tokens
        assert len(set(pages)) == len(pages), rid
        refs[pages] += 1
    np.testing.assert_array_equal(pool.refs_N, refs)
    owners = {}
    for rid, pages in held.items():
        for j, page in enumerate(pages):
            owners.setdefault(page, []).append((rid, j))
    g = pool.granule
    for page, by in owners.items():
        if len(by) > 1:  # shared: a page at the same place of prompts equal up to the end of its granule
            end = (by[0][1] // g + 1) * g * K
            ends = {tuple(prompts[rid][:end]) for rid, j in by}
            assert len(ends) == 1 and len(next(iter(ends))) == end, (page, by)
            assert len({j for _, j in by}) == 1 and page in pool.key_of
    free, cached = set(pool.free), set(pool.cached)
    assert len(free) == len(pool.free) and not free & cached and not (free | cached) & set(owners)
    assert len(free) + len(owners) + len(cached) == pool.num_pages == len(free | cached | set(owners))
    assert pool.held_pages == len(owners)
    assert cached <= set(pool.key_of) and set(pool.page_of.values()) == set(pool.key_of)


@pytest.mark.parametrize("granule", [1, 2])
def test_a_random_sequence_of_admit_grow_publish_release_keeps_the_books(granule):
    rng = random.Random(granule)
    pool = PagePool(24, K, granule)
    model, prompts, next_id = {}, {}, 0
    stems = [[rng.randrange(50) for _ in range(13)] for _ in range(3)]  # shared prefixes
    refused = grown_refused = preempted = hits = most_cached = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.35:
            prompt = rng.choice(stems)[:rng.randint(1, 13)] + [rng.randrange(50) for _ in range(rng.randint(0, 9))]
            if not prompt:
                continue
            before = pool.available
            if pool.can_admit(prompt):
                reused = pool.admit(next_id, prompt)
                assert reused % (granule * K) == 0 and reused <= len(prompt) - 1
                hits += reused > 0
                model[next_id], prompts[next_id] = len(prompt), prompt
                new = -(-len(prompt) // K) - reused // K
                assert pool.available <= before - new  # took at least its new pages
                next_id += 1
            else:
                refused += 1
                with pytest.raises(ValueError, match="needs more pages"):
                    pool.admit(next_id, prompt)
                assert pool.available == before
        elif op < 0.6 and model:
            rid = rng.choice(list(model))
            n = rng.randint(1, 6)
            need = -(-(model[rid] + n) // K) - -(-model[rid] // K)
            short = need > len(pool.free) + len(pool.cached)
            assert pool.grow(rid, n) is not short
            if short:
                grown_refused += 1
                victim = pool.newest()
                assert victim == max(model)  # the newest admitted
                pages = list(pool.requests[victim].pages)
                pool.release(victim)
                del model[victim]
                preempted += 1
                for page in pages:  # back to the free list or the cache, unless still shared
                    assert page in pool.free or page in pool.cached or pool.refs_N[page] > 0
            else:
                model[rid] += n
        elif op < 0.8 and model:
            rid = rng.choice(list(model))
            pool.publish(rid, rng.randint(0, model[rid]))
        elif model:
            rid = rng.choice(list(model))
            pool.release(rid)
            del model[rid]
        _check(pool, model, prompts)
        most_cached = max(most_cached, len(pool.cached))
    assert refused and grown_refused and preempted and hits and most_cached  # every branch ran


def test_admission_refuses_exactly_when_pages_are_short_and_counts_the_shared_prefix():
    pool = PagePool(6, K)
    prompt = list(range(4 * K))
    assert pool.can_admit(list(range(6 * K))) and not pool.can_admit(list(range(6 * K + 1)))
    assert pool.admit("a", prompt) == 0
    pool.publish("a", len(prompt))
    pool.release("a")  # its 4 pages stay cached
    assert len(pool.free) == 2 and len(pool.cached) == 4
    # 4 shared pages + 3 new > the 2 free + the 4 cached that are its own prefix: refused
    assert not pool.can_admit(prompt + [99] * 3 * K)
    assert pool.admit("b", prompt + [99] * 2 * K) == 4 * K  # 4 shared + 2 new fit
    assert pool.held_pages == 6 and not pool.can_admit([7])
    pool.release("b")
    assert pool.admit("c", prompt) == 3 * K  # its last token is prefilled, into a page of its own
    assert pool.requests["c"].pages[3] not in pool.key_of


def test_pages_no_request_holds_are_evicted_least_recently_used_only_when_the_free_list_is_empty():
    pool = PagePool(7, K)
    for rid, first in (("a", 100), ("b", 200)):
        pool.admit(rid, list(range(first, first + 2 * K)))
        pool.publish(rid, 2 * K)
    (a0, a1), (b0, b1) = pool.requests["a"].pages, pool.requests["b"].pages
    pool.release("a")
    pool.release("b")
    assert list(pool.cached) == [a1, a0, b1, b0]  # a's last page the least recent
    assert pool.admit("c", [1] * 2 * K) == 0 and len(pool.cached) == 4  # free pages first
    assert pool.grow("c", 2 * K)  # the last free page, then one eviction
    assert pool.requests["c"].pages[3] == a1 and list(pool.cached) == [a0, b1, b0]
    assert pool.admit("a2", list(range(100, 100 + 2 * K)) + [5]) == K  # a's first page is still shared
    assert pool.requests["a2"].pages == [a0, b1, b0] and not pool.cached and not pool.page_of.keys() & {b0, b1}


def test_n_requests_with_one_long_shared_prefix_hold_its_pages_once():
    n, prefix = 8, list(range(10 * K))
    pool = PagePool(64, K)
    pool.admit(0, prefix + [1])
    pool.publish(0, len(prefix))
    for rid in range(1, n):
        assert pool.admit(rid, prefix + [rid + 1, rid]) == len(prefix)
    assert pool.held_pages == 10 + n  # the prefix once, one own page a request
    shared = pool.requests[0].pages[:10]
    assert all(pool.requests[rid].pages[:10] == shared for rid in range(n))
    assert list(pool.refs_N[shared]) == [n] * 10


def test_prefixes_are_shared_in_whole_granules_once_written_and_only_when_asked():
    pool = PagePool(32, K, granule=2)  # granules of 2 pages, 2 K tokens
    prompt = list(range(5 * K))  # two whole granules and a page
    pool.admit("a", prompt)
    pool.publish("a", 3 * K)  # granule 1 is half written: only granule 0 is keyed
    assert sorted(pool.key_of) == pool.requests["a"].pages[:2]
    pool.publish("a", 5 * K)  # page 4 is no whole granule of the prompt: never keyed
    assert sorted(pool.key_of) == pool.requests["a"].pages[:4]
    a = pool.requests["a"].pages
    assert pool.admit("b", prompt) == 4 * K and pool.requests["b"].pages[:4] == a[:4]
    assert pool.admit("c", prompt[:4 * K]) == 2 * K  # its last token is prefilled: one granule reused
    assert pool.admit("d", prompt[:3 * K] + [99] * 2 * K) == 2 * K  # granule 1 differs in its 2nd page
    assert pool.requests["d"].pages[:2] == a[:2] and a[2] not in pool.requests["d"].pages
    assert pool.admit("e", prompt, share=False) == 0 and not set(pool.requests["e"].pages) & set(a)
    assert list(pool.refs_N[a]) == [4, 4, 2, 2, 1]


def test_page_table_rows_name_each_requests_pages_and_minus_one_past_them():
    pool = PagePool(8, K)
    pool.admit("x", list(range(3 * K)))
    pool.admit("y", [1])
    table_BxM = np.full((2, 4), 7, np.int32)
    pool.fill_row(table_BxM, 0, "y")
    pool.fill_row(table_BxM, 1, "x")
    np.testing.assert_array_equal(table_BxM, [[3, -1, -1, -1], [0, 1, 2, -1]])
    pool.grow("x", 2 * K)
    with pytest.raises(ValueError, match="5 pages, more than the page table's 4 columns"):
        pool.fill_row(table_BxM, 1, "x")
    second = PagePool(8, K, first_page=8)  # the pool's next block (a mesh's second batch shard)
    second.admit("z", list(range(2 * K)))
    second.fill_row(table_BxM, 0, "z")
    np.testing.assert_array_equal(table_BxM[0], [8, 9, -1, -1])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="granule >= 1"):
        PagePool(0, K)
    pool = PagePool(4, K)
    with pytest.raises(ValueError, match="empty"):
        pool.admit("a", [])
    pool.admit("a", [1])
    with pytest.raises(ValueError, match="'a' is admitted already"):
        pool.admit("a", [1])
    with pytest.raises(ValueError, match="tokens >= 1"):
        pool.grow("a", 0)
    with pytest.raises(KeyError, match="'zz' holds no pages"):
        pool.release("zz")
    pool.release("a")
    with pytest.raises(ValueError, match="nothing to preempt"):
        pool.newest()


@pytest.mark.parametrize("limit, in_use", [(80 << 30, 13 << 30), (16 << 30, 15 << 30), (10 ** 9, 0)])
def test_the_memory_default_fills_the_fraction_of_the_device_left_by_the_weights(limit, in_use):
    """Stats as a GPU's `memory_stats()` gives them: the tokens fit beside what is in use, one more would not."""
    token_bytes, fraction = 656 * 61, 0.9  # the 671B's float8 cache
    tokens = fitting_tokens({"bytes_limit": limit, "bytes_in_use": in_use, "peak_bytes_in_use": limit}, token_bytes,
                            fraction)
    if in_use >= fraction * limit:
        assert tokens == 0  # the weights already take more: the pool is refused by the runner, naming it
    else:
        assert in_use + tokens * token_bytes <= fraction * limit < in_use + (tokens + 1) * token_bytes
    assert fitting_tokens(None, token_bytes, fraction) is None  # a CPU: the caller's fallback
    with pytest.raises(ValueError, match="fraction must lie in"):
        fitting_tokens(None, token_bytes, 1.5)

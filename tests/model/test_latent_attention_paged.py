"""`attend` over a paged latent cache (a pool of pages shared by the batch, a page table per row)
against `attend` over the same tokens laid out contiguously, for every cache dtype, one query per
row (decode) and several (a verify or prefill chunk)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.ops.latent_attention import attend, encode

GARBAGE = 1e4  # what no row may read: one such key would swamp the softmax
B, H, C, R, K, M = 4, 4, 256, 16, 8, 6  # two fp8 scale groups; pages of K slots, M table entries per row
BEFORE = np.array([0, 5, 3 * K + 3, M * K])  # no prefix, under a page, four pages, a full table: 11 pages


def paged_layout(cache, cache_dtype, seed=0):
    """Contiguous (latent, scale | None, k_pe) [B, M * K, X] -> (pool stacked [2, N, K, X] to read at
    layer 1, page_table [B, M]): row b's first ceil(BEFORE[b] / K) pages at shuffled pool ids, -1 past
    them; layer 0 and the spare pages no row owns hold GARBAGE."""
    owned = -(-BEFORE // K)
    n = int(owned.sum()) + 3
    ids = iter(np.random.default_rng(seed).permutation(n))
    junk = encode(jnp.full((1, K, C), GARBAGE), jnp.full((1, K, R), GARBAGE), cache_dtype)
    pools = [None if a is None else np.repeat(np.asarray(g, a.dtype)[None], 2 * n, 0).reshape(2, n, K, -1)
             for a, g in zip(cache, junk)]
    table = np.full((B, M), -1, np.int32)
    for row, pages in enumerate(owned):
        for j in range(pages):
            table[row, j] = next(ids)
            for pool, a in zip(pools, cache):
                if pool is not None:
                    pool[1, table[row, j]] = np.asarray(a)[row, j * K:(j + 1) * K]
    return tuple(None if p is None else jnp.asarray(p) for p in pools), jnp.asarray(table)


@pytest.mark.parametrize("w", [1, 3])
@pytest.mark.parametrize("cache_dtype,compute_dtype", [("float32", jnp.float32), ("bfloat16", jnp.bfloat16),
                                                        ("float8", jnp.float32), ("int8", jnp.bfloat16)])
def test_paged_equals_contiguous(cache_dtype, compute_dtype, w):
    """Rows of no prefix, less than a page, four pages and a full table, at shuffled page ids, the last
    two sharing their first page, read two pages per work item (rows of one, several and a part item);
    slots past each row's prefix, layer 0 and spare pages hold GARBAGE; the contiguous path reads the
    same tokens."""
    ks = jax.random.split(jax.random.key(0), 6)
    past_BxSx1 = (jnp.arange(M * K) >= BEFORE[:, None])[:, :, None]
    latent = jnp.where(past_BxSx1, GARBAGE, jax.random.normal(ks[0], (B, M * K, C)))
    k_pe = jnp.where(past_BxSx1, GARBAGE, jax.random.normal(ks[1], (B, M * K, R)))
    latent, k_pe = (a.at[3, :K].set(a[2, :K]) for a in (latent, k_pe))  # rows 2 and 3 share a first page
    cache = encode(latent, k_pe, cache_dtype)
    pool, table = paged_layout(cache, cache_dtype)
    table = table.at[3, 0].set(table[2, 0])
    q_lat, q_pe = jax.random.normal(ks[2], (B, w, H, C)), jax.random.normal(ks[3], (B, w, H, R))
    own = jax.random.normal(ks[4], (B, w, C)), jax.random.normal(ks[5], (B, w, R))
    positions = jnp.asarray(BEFORE[:, None] + np.arange(w), jnp.int32)
    kw = dict(softmax_scale=0.05, compute_dtype=compute_dtype)

    want = jax.jit(lambda *a: attend(*a, block=K, **kw))(q_lat, q_pe, cache, own, positions)
    paged = jax.jit(lambda table, layer, *a: attend(*a, page_table=table, layer=layer, block=2 * K, **kw))  # both traced
    got = paged(table, jnp.int32(1), q_lat, q_pe, pool, own, positions)
    assert got.shape == (B, w, H, C) and got.dtype == jnp.float32
    want, got = np.asarray(want), np.asarray(got)
    assert np.isfinite(want).all() and np.abs(want).max() < 10  # no GARBAGE reached the contiguous path
    tol = (1e-5 if compute_dtype == jnp.float32 else 3e-3) * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_page_table_of_another_batch_is_named():
    q = jnp.zeros((B, 1, H, C))
    cache = (jnp.zeros((3, K, C)), None, jnp.zeros((3, K, R)))
    with pytest.raises(ValueError, match="page_table must be"):
        attend(q, q[..., :R], cache, (q[:, :, 0], q[:, :, 0, :R]), jnp.zeros((B, 1), jnp.int32), softmax_scale=1.0,
               compute_dtype=jnp.float32, page_table=jnp.zeros((B + 1, M), jnp.int32))

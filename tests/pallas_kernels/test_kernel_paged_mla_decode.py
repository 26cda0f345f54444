"""mla_decode over a paged latent cache (a pool of pages shared by the batch, one page table per row)
against its reference, and both against the contiguous reference on the same tokens; lowering at the
671B's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_decode, mla_decode_reference
from pallas_test_utils import LOWERINGS, lowers, quantized_cache

reference = jax.jit(mla_decode_reference, static_argnames=("softmax_scale", "return_lse"))
SPARE = 100  # what the pool's unowned pages hold: read, they would swamp the softmax


def paged_layout(caches, lengths, page_size, seed=0):
    """Lays contiguous caches [B,S,X] (S = M * page_size) out as pools [N,K,X] with page_table [B,M]:
    row b's first ceil(lengths[b] / K) pages go to distinct, shuffled pool pages, its later entries are
    -1, and the pool has spare pages no row owns (filled with SPARE)."""
    b, s = caches[0].shape[:2]
    owned = [-(-int(n) // page_size) for n in lengths]
    n_pages = sum(owned) + 3
    ids = iter(np.random.default_rng(seed).permutation(n_pages))
    table = np.full((b, s // page_size), -1, np.int32)
    pools = [np.full((n_pages, page_size) + c.shape[2:], SPARE, np.asarray(c).dtype) for c in caches]
    for row, n in enumerate(owned):
        for page in range(n):
            table[row, page] = next(ids)
            for pool, cache in zip(pools, caches):
                pool[table[row, page]] = np.asarray(cache)[row, page * page_size:(page + 1) * page_size]
    return [jnp.asarray(p) for p in pools], jnp.asarray(table)


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


def _max_abs(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


CASES = [  # (cache format, style): each style one float and one 8-bit case; the block dequantisation
    ("float32", "tpu"), ("float32", "triton"), ("bfloat16", "tpu"), ("float8", "triton"), ("int8", "tpu"),
]  # and bf16 dots are mla_decode's, checked for both styles over contiguous caches


@pytest.mark.parametrize("fmt,style", CASES)
def test_paged_equals_contiguous_and_reference(fmt, style):
    """Rows of no tokens, a third of a page, 5 pages and 7 tokens (two splits), exactly 2 pages;
    shuffled page ids, -1 past each row's pages, spare pages that must never be read."""
    k = 128 if style == "tpu" else 16  # a page is one block: TPU lanes, a Triton power of two
    b, h, r, p, m = 4, 4, 128, 16, 6
    lengths = jnp.array([0, k // 3, 5 * k + 7, 2 * k], jnp.int32)
    rng = np.random.default_rng(1)
    q_dtype = jnp.bfloat16 if fmt == "bfloat16" else jnp.float32
    q_lat, q_pe = _normal(rng, (b, h, r), q_dtype), _normal(rng, (b, h, p), q_dtype)
    kv, kp = _normal(rng, (b, m * k, r), q_dtype), _normal(rng, (b, m * k, p), q_dtype)
    scale = None
    if fmt in ("float8", "int8"):
        kv, scale, _ = quantized_cache(kv, fmt)
    pools, table = paged_layout([kv, kp] + ([scale] if scale is not None else []), lengths, k)
    paged = dict(kv_scale=pools[2] if scale is not None else None, page_table=table)
    out, lse = mla_decode(q_lat, q_pe, *pools[:2], lengths, softmax_scale=0.1, return_lse=True, backend=style,
                          interpret=True, **paged)
    ref, ref_lse = reference(q_lat, q_pe, *pools[:2], lengths, softmax_scale=0.1, return_lse=True, **paged)
    flat, flat_lse = reference(q_lat, q_pe, kv, kp, lengths, softmax_scale=0.1, return_lse=True, kv_scale=scale)
    assert out.shape == (b, h, r) and out.dtype == jnp.float32
    tol = 1e-5 * float(np.abs(np.asarray(flat)).max())
    assert _max_abs(ref, flat) < tol
    assert _max_abs(out, ref) < (10 if fmt == "bfloat16" else 1) * tol  # bf16 values: p is split hi + lo
    np.testing.assert_allclose(np.asarray(ref_lse), np.asarray(flat_lse), atol=1e-5, rtol=0)  # -inf: no tokens
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5, rtol=0)
    assert np.all(np.asarray(out)[0] == 0)


def test_errors_name_the_input():
    rng = np.random.default_rng(0)
    q_lat, q_pe = _normal(rng, (2, 4, 128), jnp.float32), _normal(rng, (2, 4, 16), jnp.float32)
    kv, kp, lengths = jnp.zeros((5, 128, 128)), jnp.zeros((5, 128, 16)), jnp.array([3, 4], jnp.int32)
    decode = lambda table, kv=kv, **kw: mla_decode(q_lat, q_pe, kv, kp, lengths, softmax_scale=0.1, page_table=table,
                                                   **kw)
    with pytest.raises(ValueError, match="page_table must be integer"):
        decode(jnp.zeros((2, 3), jnp.float32))
    with pytest.raises(ValueError, match="page_table must be integer"):
        decode(jnp.zeros((3, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"want .*\[N,K,R\], \[N,K,P\]"):
        decode(jnp.zeros((2, 3), jnp.int32), kv=kv[:4])
    with pytest.raises(ValueError, match="kv_scale.shape"):
        decode(jnp.zeros((2, 3), jnp.int32), kv_scale=jnp.ones((2, 128, 1)))
    with pytest.raises(ValueError, match="page_size=64 % 128 == 0"):
        mla_decode(q_lat, q_pe, kv[:, :64], kp[:, :64], lengths, softmax_scale=0.1, backend="tpu",
                   page_table=jnp.zeros((2, 3), jnp.int32))


@pytest.mark.parametrize("style_,platform", LOWERINGS)
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8])
def test_lowers_at_the_671b_shapes(style_, platform, cache_dtype):
    """128 heads, kv_lora 512, rope 64, pages of 128 tokens, rows of 128K tokens (traced, not allocated);
    q_pe in fp32 beside a bf16 rope key, as the model hands them (`latent_attention._decode_operands`)."""
    b, h, r, p, k = 2, 128, 512, 64, 128
    m = 128 * 1024 // k
    sds = jax.ShapeDtypeStruct
    args = [sds((b, h, r), jnp.bfloat16), sds((b, h, p), jnp.float32), sds((b * m, k, r), cache_dtype),
            sds((b * m, k, p), jnp.bfloat16), sds((b,), jnp.int32), sds((b, m), jnp.int32)]
    if cache_dtype != jnp.bfloat16:
        args.append(sds((b * m, k, r // 128), jnp.float32))
    f = lambda *a: mla_decode(*a[:5], page_table=a[5], kv_scale=a[6] if len(a) > 6 else None,
                              softmax_scale=192 ** -0.5, backend=style_, interpret=False)
    lowers(f, args, platform)

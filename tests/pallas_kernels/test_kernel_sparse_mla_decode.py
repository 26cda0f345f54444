"""sparse_mla_decode (DSA's absorbed decode over the selected rows) against its reference, the
reference against numpy and against dense MLA decode, and lowering at the 671B's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (BlockSizesSparseMlaDecode, mla_decode_reference, sparse_mla_decode,
                            sparse_mla_decode_reference)
from pallas_test_utils import LOWERINGS, lowers, quantized_cache

reference = jax.jit(sparse_mla_decode_reference, static_argnames=("softmax_scale", "paged"))  # one compile per op set


def numpy_sparse_attention(q_lat, q_pe, kv, kp, indices, scale):
    """Softmax over only the rows each query selected (entries in [0, S)), float64, loop over rows."""
    b, h, r = q_lat.shape
    out, lse = np.zeros((b, h, r)), np.full((b, h), -np.inf)
    for i in range(b):
        rows = [int(j) for j in indices[i] if 0 <= j < kv.shape[1]]
        if not rows:
            continue
        s = (q_lat[i] @ kv[i, rows].T + q_pe[i] @ kp[i, rows].T) * scale
        mx = s.max(axis=1, keepdims=True)
        e = np.exp(s - mx)
        out[i] = (e / e.sum(axis=1, keepdims=True)) @ kv[i, rows]
        lse[i] = mx[:, 0] + np.log(e.sum(axis=1))
    return out, lse


def _inputs(b, h, r, p, s, dtype, seed=0):
    """q_latent, q_pe, kv_latent, k_pe: standard normal (numpy's generator: no compile per shape)."""
    rng = np.random.default_rng(seed)
    shapes = [(b, h, r), (b, h, p), (b, s, r), (b, s, p)]
    return [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes]


def _indices(lengths, k, seed=0):
    """[B, K]: a random choice of distinct visible positions per row, -1 where K exceeds the length."""
    rng = np.random.default_rng(seed)
    out = np.full((len(lengths), k), -1, np.int32)
    for i, n in enumerate(lengths):
        chosen = rng.permutation(n)[:k]
        out[i, rng.permutation(k)[:len(chosen)]] = chosen  # -1s scattered, not only at the end
    return out


def _f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


def _max_abs(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def test_reference_matches_numpy():
    args = _inputs(3, 4, 32, 8, 40, jnp.float32)
    idx = _indices([40, 17, 0], 24)
    idx[0, :3] = [40, 1000, -7]  # out of [0, S): no entry
    out, lse = reference(*args, jnp.asarray(idx), softmax_scale=0.2)
    want_out, want_lse = numpy_sparse_attention(*_f64(*args), idx, 0.2)
    assert _max_abs(out, want_out) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5)


def test_selecting_every_visible_row_equals_dense_decode():
    """Below index_topk visible tokens the sparse step is dense attention: the selection holds every
    position s < lengths[b] (in any order, -1 padded) and the answer is mla_decode_reference's."""
    args = _inputs(3, 4, 32, 8, 50, jnp.float32, seed=1)
    lengths = [50, 9, 1]
    idx = jnp.asarray(_indices(lengths, 64, seed=1))
    out, lse = reference(*args, idx, softmax_scale=0.3)
    dense, dense_lse = jax.jit(mla_decode_reference, static_argnames=("softmax_scale", "return_lse"))(
        *args, jnp.asarray(lengths), softmax_scale=0.3, return_lse=True)
    assert _max_abs(out, dense) < 1e-5 and _max_abs(lse, dense_lse) < 1e-5


def test_kernel_matches_reference(style):
    """bf16 inputs, K beyond the shorter rows' lengths (-1 padded), a row with no entry, 2 splits
    (the second mostly -1); Triton: 2 head blocks."""
    b, h, r, p, s, k, lengths = 3, 20, 128, 16, 200, 160, [200, 70, 0]
    args = _inputs(b, h, r, p, s, jnp.bfloat16)
    idx = jnp.asarray(_indices(lengths, k))
    bs = BlockSizesSparseMlaDecode(block_k=128 if style == "tpu" else 32, num_splits=2)
    out, lse = sparse_mla_decode(*args, idx, softmax_scale=0.125, block_sizes=bs, backend=style, interpret=True)
    ref, ref_lse = reference(*args, idx, softmax_scale=0.125)
    assert out.shape == (b, h, r) and out.dtype == jnp.float32 and lse.shape == (b, h)
    assert _max_abs(out, ref) < 1e-4  # bf16 inputs are exact in fp32; p is split hi + lo for the bf16 dot
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4, rtol=0)  # -inf where no entry
    assert np.all(np.asarray(out)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))


@pytest.mark.parametrize("fmt,style", [("float8", "tpu"), ("float8", "triton"), ("int8", "triton")])
def test_quantized_cache_dequantised_per_block(fmt, style):
    """An 8-bit cache: the kernel's per-block dequantisation and the reference against numpy on the
    cache dequantised up front (the numbers the cache stands for). int8 takes the same block code
    as fp8 (a cast, then the per-128 scales), so one style checks it."""
    q_lat, q_pe, kv, kp = _inputs(2, 4, 256, 16, 260, jnp.float32, seed=3)
    kv = kv * jnp.linspace(0.1, 20, 256)  # scales that differ between the 128-value groups
    cache, scale, deq = quantized_cache(kv, fmt)
    idx = _indices([260, 100], 160, seed=3)
    want, want_lse = numpy_sparse_attention(*_f64(q_lat, q_pe), deq, np.asarray(kp, np.float64), idx, 0.05)
    got, lse = sparse_mla_decode(q_lat, q_pe, cache, kp, jnp.asarray(idx), softmax_scale=0.05, kv_scale=scale,
                                 block_sizes=BlockSizesSparseMlaDecode(block_k=128 if style == "tpu" else 32),
                                 backend=style, interpret=True)
    ref, ref_lse = reference(q_lat, q_pe, cache, kp, jnp.asarray(idx), softmax_scale=0.05, kv_scale=scale)
    tol = 1e-5 * np.abs(want).max()  # relative: the scaled latents give outputs up to ~60
    assert _max_abs(got, want) < tol and _max_abs(lse, want_lse) < 1e-4
    assert _max_abs(ref, want) < tol and _max_abs(ref_lse, want_lse) < 1e-4


def test_paged_pool_indexed_by_slot(style):
    """paged=True: the cache is a pool of pages [N, K, R] shared by the rows (fp8, with its scales)
    and an index names the pool's slot page * K + offset: numpy over each row's pages laid out
    contiguously (its 4 pages of 16 shuffled among pages no row owns) and the same logical indices."""
    b, h, r, p, k, m, n = 2, 4, 128, 16, 16, 4, 10  # K slots per page, M pages per row, N in the pool
    q_lat, q_pe, _, _ = _inputs(b, h, r, p, 1, jnp.float32, seed=4)
    _, _, kv, kp = _inputs(1, h, r, p, n * k, jnp.float32, seed=5)
    cache, scale, deq = quantized_cache(kv, "float8")
    table = np.random.default_rng(4).permutation(n)[:b * m].reshape(b, m)
    idx = _indices([m * k, 37], 24, seed=4)  # logical slots of each row
    slots = np.where(idx >= 0, table[np.arange(b)[:, None], np.maximum(idx, 0) // k] * k + idx % k, -1)
    rows = lambda a: np.asarray(a, np.float64).reshape(n, k, -1)[table].reshape(b, m * k, -1)
    want, want_lse = numpy_sparse_attention(*_f64(q_lat, q_pe), rows(deq), rows(kp), idx, 0.1)
    pool = [a.reshape(n, k, -1) for a in (cache, kp, scale)]
    got, lse = sparse_mla_decode(q_lat, q_pe, *pool[:2], jnp.asarray(slots), softmax_scale=0.1, kv_scale=pool[2],
                                 block_sizes=BlockSizesSparseMlaDecode(block_k=128 if style == "tpu" else 32),
                                 backend=style, interpret=True, paged=True)
    ref, ref_lse = reference(q_lat, q_pe, *pool[:2], jnp.asarray(slots), softmax_scale=0.1, kv_scale=pool[2],
                             paged=True)
    assert _max_abs(got, want) < 1e-4 and _max_abs(lse, want_lse) < 1e-4
    assert _max_abs(ref, want) < 1e-4 and _max_abs(ref_lse, want_lse) < 1e-4


def test_errors_name_the_input():
    args = _inputs(2, 4, 128, 16, 64, jnp.float32)
    with pytest.raises(ValueError, match="indices must be integer"):
        sparse_mla_decode(*args, jnp.zeros((2, 8), jnp.float32), softmax_scale=0.1)
    with pytest.raises(ValueError, match="kv_scale.shape"):
        sparse_mla_decode(*args, jnp.zeros((2, 8), jnp.int32), softmax_scale=0.1, kv_scale=jnp.ones((2, 64, 2)))
    with pytest.raises(ValueError, match="block_k=100 % 128 == 0"):
        sparse_mla_decode(*args, jnp.zeros((2, 8), jnp.int32), softmax_scale=0.1, backend="tpu",
                          block_sizes=BlockSizesSparseMlaDecode(block_k=100))


@pytest.mark.parametrize("style_,platform", LOWERINGS)
@pytest.mark.parametrize("cache_dtype,paged", [(jnp.bfloat16, False), (jnp.float8_e4m3fn, False),
                                               (jnp.float8_e4m3fn, True)])
def test_lowers_at_the_671b_shapes(style_, platform, cache_dtype, paged):
    """128 heads, kv_lora 512, rope 64, index_topk 2048 over a 128K-token cache (traced, not
    allocated); `paged`: a pool of 2 x 128K tokens in pages of 64. q_pe in fp32 beside a bf16 rope key,
    as the model hands them (`latent_attention._decode_operands`)."""
    b, h, r, p, s, k = 2, 128, 512, 64, 128 * 1024, 2048
    rows, slots = (b * s // 64, 64) if paged else (b, s)
    sds = jax.ShapeDtypeStruct
    args = [sds((b, h, r), jnp.bfloat16), sds((b, h, p), jnp.float32), sds((rows, slots, r), cache_dtype),
            sds((rows, slots, p), jnp.bfloat16), sds((b, k), jnp.int32)]
    if cache_dtype == jnp.float8_e4m3fn:
        args.append(sds((rows, slots, r // 128), jnp.float32))
    f = lambda *a: sparse_mla_decode(*a[:5], kv_scale=a[5] if len(a) > 5 else None, softmax_scale=192 ** -0.5,
                                     backend=style_, interpret=False, paged=paged)
    lowers(f, args, platform)

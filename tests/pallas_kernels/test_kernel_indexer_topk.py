"""DSA's selection: indexer_scores against its reference, the reference against numpy written from
the lightning indexer's equation, topk_indices' properties, and lowering at the 671B's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockSizesIndexer, indexer_scores, indexer_scores_reference, topk_indices
from pallas_test_utils import LOWERINGS, lowers

reference = jax.jit(indexer_scores_reference)  # one compile, not one per op


def numpy_index_scores(q, w, k, lengths):
    """score[b,s] = sum_n w[b,n] * max(q[b,n] . k[b,s], 0) for s < lengths[b], else -inf; float64 loops."""
    b, n, _ = q.shape
    out = np.full((b, k.shape[1]), -np.inf)
    for i in range(b):
        for s in range(int(lengths[i])):
            out[i, s] = sum(w[i, j] * max(float(q[i, j] @ k[i, s]), 0.0) for j in range(n))
    return out


def _inputs(b, n, d, s, seed=0):
    """q [B,N,D], w [B,N] (signed, as weights_proj gives them), k [B,S,D]: standard normal."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in [(b, n, d), (b, n), (b, s, d)])


def _fp8_rows(k_BxSxD):
    """e4m3 keys with one positive scale per row (amax / 448) and the float64 values they stand for."""
    scale = jnp.max(jnp.abs(k_BxSxD), axis=-1, keepdims=True) / 448.0
    k8 = (k_BxSxD / scale).astype(jnp.float8_e4m3fn)
    return k8, scale, np.asarray(k8, np.float64) * np.asarray(scale, np.float64)


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_matches_numpy(fp8):
    q, w, k = _inputs(2, 4, 16, 30)
    lengths = np.array([30, 11])
    k_scale = None
    k_values = np.asarray(k, np.float64)
    if fp8:
        k, k_scale, k_values = _fp8_rows(k)
    got = reference(q, w, k, jnp.asarray(lengths), k_scale=k_scale)
    want = numpy_index_scores(np.asarray(q, np.float64), np.asarray(w, np.float64), k_values, lengths)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_matches_reference(fp8, style):
    """Lengths 0, inside a block and past a block edge; 64 heads of dim 128 as in V3.2."""
    q, w, k = _inputs(3, 64, 128, 300, seed=1)
    k_scale = None
    if fp8:
        k, k_scale, _ = _fp8_rows(k)
    lengths = jnp.array([0, 100, 300], jnp.int32)
    bs = BlockSizesIndexer(block_s=128 if style == "tpu" else 64)
    got = indexer_scores(q, w, k, lengths, k_scale=k_scale, block_sizes=bs, backend=style, interpret=True)
    want = reference(q, w, k, lengths, k_scale=k_scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)  # -inf where invisible


def test_topk_indices_pick_the_best_visible_positions():
    scores = np.array([[0.5, 3.0, -1.0, 2.0, -np.inf, -np.inf],
                       [-np.inf] * 6], np.float32)
    got = np.asarray(topk_indices(jnp.asarray(scores), 5))
    np.testing.assert_array_equal(got[0], [1, 3, 0, 2, -1])  # best first; 4 visible, then -1
    np.testing.assert_array_equal(got[1], [-1] * 5)
    assert np.asarray(topk_indices(jnp.asarray(scores), 8)).shape == (2, 8)  # topk beyond S: -1 padded


def test_errors_name_the_input():
    q, w, k = _inputs(2, 4, 16, 30)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        indexer_scores(q, w[:, :3], k, jnp.array([1, 2]))
    with pytest.raises(ValueError, match="k_scale.shape"):
        indexer_scores(q, w, k, jnp.array([1, 2]), k_scale=jnp.ones((2, 30)))


@pytest.mark.parametrize("style_,platform", LOWERINGS)
@pytest.mark.parametrize("key_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_lowers_at_the_671b_shapes(style_, platform, key_dtype):
    """64 index heads of dim 128 over a 128K-token index-key cache (traced, not allocated)."""
    b, n, d, s = 2, 64, 128, 128 * 1024
    sds = jax.ShapeDtypeStruct
    args = [sds((b, n, d), jnp.bfloat16), sds((b, n), jnp.float32), sds((b, s, d), key_dtype), sds((b,), jnp.int32)]
    if key_dtype == jnp.float8_e4m3fn:
        args.append(sds((b, s, 1), jnp.float32))
    f = lambda *a: indexer_scores(*a[:4], k_scale=a[4] if len(a) > 4 else None, backend=style_, interpret=False)
    lowers(f, args, platform)

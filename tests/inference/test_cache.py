"""Latent cache: bytes per token against the theory, fp8 layout, decode logits against the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import ModelConfig
from dsv3_jax.inference import cache_bytes_per_token, init_cache
from dsv3_jax.ops.latent_attention import dequantize as decode_latent, encode


def test_bytes_per_token_671b():
    cfg = ModelConfig.deepseek_v3()
    assert cache_bytes_per_token(cfg, "bfloat16") == (512 + 64) * 2 == 1152
    assert cache_bytes_per_token(cfg, "float8") == 512 + 4 * 4 + 64 * 2 == 656  # FlashMLA layout
    assert cache_bytes_per_token(cfg, "int8") == 512 + 4 + 64 * 2 == 644  # one fp32 scale per token
    assert cache_bytes_per_token(cfg, "float32") == (512 + 64) * 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8", "int8"])
def test_allocated_cache_matches_reported_bytes(dtype):
    cfg = ModelConfig.deepseek_v3()
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 32, dtype, with_mtp=True))
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
    assert nbytes == cache_bytes_per_token(cfg, dtype) * (cfg.num_layers + cfg.num_mtp_layers) * 2 * 32


def test_fp8_latent_within_e4m3_rounding():
    x = jax.random.normal(jax.random.key(0), (2, 5, 512)) * jnp.linspace(0.01, 30, 512)
    q, scale, k_pe = encode(x, jnp.ones((2, 5, 64)), "float8")
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (2, 5, 4) and k_pe.dtype == jnp.bfloat16
    err = np.abs(np.asarray(decode_latent(q, scale, jnp.float32)) - np.asarray(x))
    block_max = np.repeat(np.abs(np.asarray(x)).reshape(2, 5, 4, 128).max(-1), 128, axis=-1)
    assert (err <= 2.0 ** -4 * np.abs(np.asarray(x)) + block_max / 448 * 2.0 ** -6).all()


def test_int8_latent_is_numpys_symmetric_per_token_rounding():
    x = jax.random.normal(jax.random.key(1), (2, 5, 512)) * jnp.linspace(0.01, 30, 512)
    x = x.at[1, 3].set(0.0)  # an all-zero token stays zero (no 0 / 0)
    q, scale, k_pe = encode(x, jnp.ones((2, 5, 64)), "int8")
    assert q.dtype == jnp.int8 and scale.shape == (2, 5, 1) and k_pe.dtype == jnp.bfloat16
    xn = np.asarray(x, np.float64)
    amax = np.abs(xn).max(-1, keepdims=True)
    want_q = np.rint(xn / np.where(amax > 0, amax / 127, 1.0))
    np.testing.assert_array_equal(np.asarray(q), want_q)  # exact up to fp32 ties
    back = np.asarray(decode_latent(q, scale, jnp.float32))
    assert (np.abs(back - xn) <= amax / 127 / 2 * (1 + 1e-6)).all()  # half a step of its token's grid
    assert not np.isnan(back).any() and (back[1, 3] == 0).all()


# fp8: e4m3 keeps 3 mantissa bits (relative rounding up to 2^-4 per latent value); through three
# layers of this deliberately large-weight model that moves logits by a few percent of their range.
# int8: 255 levels per token (step amax / 127) against e4m3's relative 2^-4: about as close.
@pytest.mark.parametrize("cache_dtype, rel_tol", [("float32", 2e-5), ("float8", 0.1), ("int8", 0.1)])
def test_decode_step_logits_match_full_forward(model, ragged_batch, cache_dtype, rel_tol):
    """Prefill T-1 tokens, decode the last one over the cache; compare with the full forward at T-1."""
    tokens = jnp.asarray(np.abs(ragged_batch[0]))
    b, t = tokens.shape
    graphdef, state = nnx.split(model)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        cache = init_cache(m.config, b, 16, cache_dtype)
        cache = m.forward(tokens[:, :-1], positions=pos[:, :-1], with_mtp=False, cache=cache).cache
        return m.forward(tokens[:, -1:], positions=pos[:, -1:], with_mtp=False, cache=cache).logits[:, 0]

    want = np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(tokens))(state))[:, -1]
    got = np.asarray(run(state))
    assert np.std(want) > 1.0  # O(1) logits: the tolerance is meaningful
    np.testing.assert_allclose(got, want, atol=rel_tol * np.abs(want).max(), rtol=0)

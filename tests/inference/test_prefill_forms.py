"""Prefill chunks run MLA's expanded form over the latent cache (model/attention.py
`expanded_chunk`), decode the absorbed one: both against the full forward (no cache) and against
each other on a cache whose rows start at different positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax.inference.cache import init_cache
from dsv3_jax.model.attention import EXPANDED_MIN_WIDTH, LatentCache
from dsv3_jax.ops import latent_attention
from tests.inference.conftest import VOCAB, tiny_config

T = 3 * EXPANDED_MIN_WIDTH + 5  # three expanded chunks, then an absorbed tail of 5 tokens


def _chunked_logits(model, tokens, cache_dtype="float32"):
    """Logits of `tokens` [B, T] fed through the cache in chunks of EXPANDED_MIN_WIDTH, then 5."""
    b, t = tokens.shape
    graphdef, state = nnx.split(model)
    spans = [(a, min(EXPANDED_MIN_WIDTH, t - a)) for a in range(0, t, EXPANDED_MIN_WIDTH)]

    @jax.jit
    def run(state):
        m, cache, out = nnx.merge(graphdef, state), init_cache(model.config, b, 64, cache_dtype), []
        for start, width in spans:
            pos = jnp.broadcast_to(jnp.arange(start, start + width, dtype=jnp.int32), (b, width))
            step = m.forward(tokens[:, start:start + width], positions=pos, with_mtp=False, cache=cache)
            cache = step.cache
            out.append(step.logits)
        return jnp.concatenate(out, axis=1)

    return np.asarray(run(state))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_chunked_prefill_equals_the_full_forward(impl):
    from dsv3_jax import DeepSeekV3

    model = DeepSeekV3(tiny_config(compute_dtype="float32", attention_impl=impl), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, VOCAB, jnp.int32)
    want = np.asarray(nnx.jit(lambda m, x: m(x))(model, tokens))
    got = _chunked_logits(model, tokens)
    assert np.std(want) > 1.0  # O(1) logits: the tolerance is meaningful
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("cache_dtype", ["float32", "float8"])
def test_expanded_prefix_equals_absorbed_attention(cache_dtype):
    """attend_expanded over the prefix, merged with the chunk's own causal attention, equals the
    absorbed `attend` (which never expands) with per-row starts 0, 11 and 37 on one cache."""
    from dsv3_jax.ops.attention import causal_attention_lse

    b, w, h, n, r, v, c, s = 3, 6, 3, 8, 4, 5, 16, 64
    ks = jax.random.split(jax.random.key(1), 8)
    q_nope, q_pe = jax.random.normal(ks[0], (b, w, h, n)), jax.random.normal(ks[1], (b, w, h, r))
    w_uk, w_uv = 0.3 * jax.random.normal(ks[2], (c, h, n)), 0.3 * jax.random.normal(ks[3], (c, h, v))
    latent, k_pe = jax.random.normal(ks[4], (b, s, c)), jax.random.normal(ks[5], (b, s, r))
    cache = LatentCache(*latent_attention.encode(latent, k_pe, cache_dtype))
    own = jax.random.normal(ks[6], (b, w, c)), jax.random.normal(ks[7], (b, w, r))
    positions = jnp.array([0, 11, 37], jnp.int32)[:, None] + jnp.arange(w, dtype=jnp.int32)
    kw = dict(softmax_scale=0.4, compute_dtype=jnp.float32)

    q_lat = jnp.einsum("BWHN,CHN->BWHC", q_nope, w_uk)
    want = jnp.einsum("BWHC,CHV->BWHV", latent_attention.attend(q_lat, q_pe, cache, own, positions, block=16, **kw),
                      w_uv)
    prefix, prefix_lse = latent_attention.attend_expanded(q_nope, q_pe, w_uk, w_uv, cache, positions, block=16, **kw)
    k = jnp.concatenate([jnp.einsum("BWC,CHN->BWHN", own[0], w_uk),
                         jnp.broadcast_to(own[1][:, :, None], (b, w, h, r))], axis=-1)
    fresh, fresh_lse = causal_attention_lse(jnp.concatenate([q_nope, q_pe], -1), k,
                                            jnp.einsum("BWC,CHV->BWHV", own[0], w_uv), softmax_scale=0.4)
    got = latent_attention.merge(prefix, prefix_lse, fresh, fresh_lse)
    assert np.isneginf(np.asarray(prefix_lse[0])).all()  # a row at position 0 has no prefix
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

"""attention_impl="pallas" routes the one-token absorbed decode through pallas_kernels.mla_decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.model import LatentCache
from dsv3_jax.model.rope import rope_angles
from dsv3_jax.ops.latent_attention import encode
from tests.inference.conftest import tiny_config


@pytest.mark.parametrize("cache_dtype", ["float32", "float8", "int8"])
def test_pallas_decode_equals_xla_decode(cache_dtype):
    """Both read the cache block by block (an fp8 or int8 block dequantised as read): same numbers."""
    b, s, cfg = 2, 40, tiny_config(num_layers=1, num_dense_layers=1, num_mtp_layers=0)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (b, 1, cfg.hidden_size))
    cache = LatentCache(*encode(jax.random.normal(keys[1], (b, s, cfg.kv_lora_rank)),
                                jax.random.normal(keys[2], (b, s, cfg.qk_rope_head_dim)), cache_dtype))
    positions = jnp.array([[7], [33]], jnp.int32)
    cos, sin = rope_angles(positions, cfg)
    outs = {}
    for impl in ("xla", "pallas"):
        attn = DeepSeekV3(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(0)).dense_layers.attn
        layer = jax.tree.map(lambda a: a[0], nnx.state(attn))
        graphdef = nnx.graphdef(attn)

        @jax.jit
        def run(state):
            return nnx.merge(graphdef, state)(x, cos, sin, cache=cache, positions=positions)

        out, entries = run(layer)
        outs[impl] = np.asarray(out)
        assert entries.latent.shape == (b, 1, cfg.kv_lora_rank)
    assert np.std(outs["xla"]) > 0.1
    np.testing.assert_allclose(outs["pallas"], outs["xla"], rtol=2e-4, atol=2e-4 * np.abs(outs["xla"]).max())

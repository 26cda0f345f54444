"""Sharded decoding on 8 fake CPU devices: heads of wkv_b / wo on `tensor`, the cache batch on `data`."""

import sys

from tests import helpers

SCRIPT = r'''
import os
from tests.helpers import fake_device_flags
os.environ["XLA_FLAGS"] = fake_device_flags(8)
import jax, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from flax import nnx
from dsv3_jax import DeepSeekV3
from dsv3_jax.inference import Generation
from tests.inference.conftest import tiny_config

assert jax.device_count() == 8
mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
model = DeepSeekV3(tiny_config(), rngs=nnx.Rngs(0))

def spec(path, leaf):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if "attn/wkv_b" in name and leaf.ndim == 4:  # [L, C, H, N + V]
        return NamedSharding(mesh, P(None, None, "tensor", None))
    if "attn/wo" in name and leaf.ndim == 4:  # [L, H, V, D]
        return NamedSharding(mesh, P(None, "tensor", None, None))
    return NamedSharding(mesh, P())

state = nnx.state(model)
shardings = jax.tree_util.tree_map_with_path(spec, state)
prompts = np.random.RandomState(0).randint(0, 64, (2, 5)).astype(np.int32)
lengths = np.array([5, 3], np.int32)
plain = Generation(model, prompts, 6, lengths=lengths)
list(plain)
sharded = Generation(model, prompts, 6, lengths=lengths, param_shardings=shardings,
                     cache_sharding=NamedSharding(mesh, P(None, "data")))
list(sharded)
np.testing.assert_array_equal(sharded.output(), plain.output())
assert sharded.cache.moe.latent.sharding.spec == P(None, "data"), sharded.cache.moe.latent.sharding
wkv_b = jax.tree_util.tree_leaves(sharded.state["moe_layers"]["attn"]["wkv_b"])[0]
assert wkv_b.sharding.spec == P(None, None, "tensor", None), wkv_b.sharding
print("SHARDED_OK", sharded.output().tolist())
'''


def test_sharded_decode_gives_the_same_tokens():
    res = helpers.run([sys.executable, "-c", SCRIPT], helpers.fake_device_env(), timeout=900)
    assert res.returncode == 0 and "SHARDED_OK" in res.stdout, res.stderr[-4000:]

"""The sharded start (dsv3_jax/train/state.py): a run's state is built abstractly, then made under
jit in its shardings; the numbers are those of building the model eagerly on one device."""

import jax
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.train import checkpointing, optimizer, state as state_lib
from experiments.configs.tiny import get_config
from tests.helpers import shrunk_tiny_config

CFG = shrunk_tiny_config(vocab_size=64)
SEED = 3


@pytest.fixture(scope="module")
def pieces():
    def make_model():
        return DeepSeekV3(CFG, rngs=nnx.Rngs(SEED))

    model = nnx.eval_shape(make_model)
    _, params, _ = state_lib.split_model(model)
    tx = optimizer.make_optimizer(get_config().optimizer, 10, optimizer.decay_mask(params))
    graphdef, abstract = state_lib.abstract_train_state(model, tx, SEED)
    return make_model, tx, graphdef, abstract


def test_fresh_state_under_jit_is_the_eager_build_up_to_rounding(pieces):
    make_model, tx, _, abstract = pieces
    shardings = state_lib.on_one_device(abstract)
    got = state_lib.fresh_train_state(make_model, tx, SEED, shardings)
    _, want = state_lib.init_train_state(DeepSeekV3(CFG, rngs=nnx.Rngs(SEED)), tx, SEED)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        # The same random bits; the jitted init is compiled differently from the op-by-op build
        # (fused, cheap CPU code), so a float may differ in its last bits, never more.
        if np.issubdtype(np.asarray(w).dtype, np.floating):
            np.testing.assert_array_max_ulp(np.asarray(g), np.asarray(w), maxulp=4)
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))
        assert g.sharding.device_set == {jax.local_devices()[0]}


def test_abstract_state_has_the_shapes_of_the_made_one_and_allocates_nothing(pieces):
    make_model, tx, _, abstract = pieces
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    made = state_lib.fresh_train_state(make_model, tx, SEED, state_lib.on_one_device(abstract))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract) == jax.tree.map(lambda x: (x.shape, x.dtype), made)
    # A restore target for Orbax: ShapeDtypeStructs in the state's shardings.
    target = checkpointing.abstract_like(abstract, state_lib.on_one_device(abstract))
    assert {x.sharding.device_set.pop() for x in jax.tree.leaves(target)} == {jax.local_devices()[0]}

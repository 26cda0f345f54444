"""Run by test_mesh.py in a subprocess with 8 fake CPU devices (XLA_FLAGS set before jax import).

    python -m tests.checkpoint._mesh_restore HF_DIR CKPT_DIR KEPT_FP8_CKPT_DIR
"""

import os
import sys

from tests.helpers import fake_device_flags

os.environ.setdefault("XLA_FLAGS", fake_device_flags(8))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from dsv3_jax.checkpoint import load_pretrained  # noqa: E402
import sharding  # noqa: E402
from dsv3_jax.model.params import logical_axes  # noqa: E402


def variables(model):
    return {".".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}


def partition_spec(logical, shape, mesh, rules="default"):
    return sharding.logical_to_spec(logical, shape, mesh, sharding.get_rules(rules))


def check(model, mesh, spec_of):
    sharded = 0
    for name, var in variables(model).items():
        value = var[...]
        want = NamedSharding(mesh, spec_of(name, var))
        assert value.sharding.is_equivalent_to(want, value.ndim), (name, value.sharding, want)
        sharded += any(a is not None for a in want.spec)
    return sharded


def main(hf_dir, ckpt, kept):
    assert jax.device_count() == 8
    mesh = jax.make_mesh((2, 2, 2), ("fsdp", "expert", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) % 96
    ref = np.asarray(load_pretrained(ckpt)(tokens))
    model = load_pretrained(ckpt, mesh=mesh)
    n = check(model, mesh, lambda name, v: partition_spec(logical_axes(v), v.shape, mesh))
    assert n >= 10, n
    assert variables(model)["moe_layers.ffn.w1"][...].sharding.spec == P(None, "expert", "fsdp", "tensor")
    np.testing.assert_allclose(np.asarray(model(tokens)), ref, rtol=1e-5, atol=1e-5)
    # Rules as a dict (only experts sharded) and as a preset of sharding/rules.py.
    only_experts = {a: None for a in sharding.get_rules("default")} | {"expert": "expert"}
    model = load_pretrained(ckpt, mesh=mesh, rules=only_experts)
    check(model, mesh, lambda name, v: P(*[("expert" if a == "expert" else None) for a in logical_axes(v)]))
    model = load_pretrained(ckpt, mesh=mesh, rules="fsdp")
    check(model, mesh, lambda name, v: partition_spec(logical_axes(v), v.shape, mesh, "fsdp"))
    # FP8 kept in the checkpoint: dequantised on the host, then placed on the same shardings.
    model = load_pretrained(kept, mesh=mesh)
    check(model, mesh, lambda name, v: partition_spec(logical_axes(v), v.shape, mesh))
    np.testing.assert_allclose(np.asarray(model(tokens)), ref, rtol=1e-5, atol=1e-5)
    # HF folders take the same mesh.
    model = load_pretrained(hf_dir, mesh=mesh)
    check(model, mesh, lambda name, v: partition_spec(logical_axes(v), v.shape, mesh))
    np.testing.assert_allclose(np.asarray(model(tokens)), ref, rtol=1e-2, atol=1e-2)
    print("MESH OK")


if __name__ == "__main__":
    main(*sys.argv[1:])

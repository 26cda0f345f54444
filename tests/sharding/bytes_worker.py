"""Places the tiny model's parameters on (fsdp=2, tensor=2, expert=2) over 8 fake CPU devices and
prints, per parameter, the bytes device 0 holds against total / shards (JSON, last line)."""

import json
import os

from tests.helpers import fake_device_flags

os.environ.setdefault("XLA_FLAGS", fake_device_flags(8))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import sharding  # noqa: E402
from dsv3_jax import DeepSeekV3, ModelConfig  # noqa: E402
from dsv3_jax.train import sharded, state as state_lib  # noqa: E402


def main():
    model = DeepSeekV3(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    _, params, _ = state_lib.split_model(model)
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
    rows, device_total, expected, total = [], 0, 0, 0
    for path, (shape, sh) in sharded.variable_shardings(params, mesh, sharding.get_rules("default")).items():
        value = params
        for key in path:
            value = value[key]
        placed = jax.device_put(value[...], sh)
        nbytes = int(np.prod(shape)) * placed.dtype.itemsize
        shards = sharding.shards_of(sh.spec, mesh)
        on_device0 = sum(s.data.nbytes for s in placed.addressable_shards if s.device == jax.devices()[0])
        rows.append({"path": "/".join(path), "spec": str(sh.spec), "shards": shards, "total_bytes": nbytes,
                     "device_bytes": on_device0})
        device_total += on_device0
        expected += nbytes // shards
        total += nbytes
    print(json.dumps({"devices": jax.device_count(), "params": rows, "device_total": device_total,
                      "expected_device_total": expected, "total": total,
                      "sharded_params": sum(r["shards"] > 1 for r in rows)}))


if __name__ == "__main__":
    main()

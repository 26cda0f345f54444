"""Run by test_quantized_load.py in a subprocess with 8 fake CPU devices: quantized loads onto a
fsdp=2 x expert=4 mesh (FP8 experts and FP8 everywhere from an FP8 folder, int4 everywhere from
fp32) give the single-device quantized model's logits under the context mesh (expert parallelism),
the experts' q and scales split over `expert`. FP8 everywhere is the sensitive one: its activations
are rounded to e4m3 before every projection, so a norm summed in partial sums over `fsdp` (one fp32
rounding off) flipped an element and moved the logits by 2e-2 (dsv3_jax/model/norm.py).

    python -m tests.checkpoint._quant_mesh FP8_HF_DIR FP32_HF_DIR
"""

import os
import sys

from tests.helpers import fake_device_flags

os.environ.setdefault("XLA_FLAGS", fake_device_flags(8))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import sharding  # noqa: E402
from dsv3_jax.checkpoint import load_pretrained  # noqa: E402


def logits(model):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)))
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


def main(fp8_dir, fp32_dir):
    mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
    cases = ((fp8_dir, "fp8", "experts"), (fp8_dir, "fp8", "all"), (fp32_dir, "int4", "all"))
    for folder, weights, which in cases:
        kw = dict(weights=weights, quantize=which, quant_group=16, compute_dtype="float32")
        one = logits(load_pretrained(folder, **kw))
        model = load_pretrained(folder, mesh=mesh, **kw)
        w1 = model.moe_layers.ffn.w1[...]
        for a in (w1.q, w1.scale):
            assert "expert" in str(a.sharding.spec), (weights, a.sharding)
            assert len(a.addressable_shards) == 8
        with jax.set_mesh(mesh):  # the context mesh: the MoE runs expert parallelism over `expert`
            got = logits(model)
        err = float(np.abs(got - one).max() / np.abs(one).max())
        print(f"{weights} {which}: mesh logits rel err {err:.2e}, w1.q {w1.q.sharding.spec}")
        assert err < 1e-5, err


if __name__ == "__main__":
    main(*sys.argv[1:])

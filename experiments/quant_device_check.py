"""Device check of the quantized paths on a GPU/TPU (prints figures, asserts nothing): the Pallas
int8/int4 grouped kernel compiled natively against its jnp reference (f32 and bf16 activations),
the routed experts' auto/ragged/tiled paths against the dense reference over int8/int4 QArrays,
and stored FP8 experts through the block-scaled grouped kernel against a bf16 matmul of the
dequantized weights.

    python -m experiments.quant_device_check
"""
import time, jax, jax.numpy as jnp, numpy as np
print(jax.devices())
from dsv3_jax.ops import dispatch, quant
from pallas_kernels.quant_grouped_matmul import quant_grouped_matmul, quant_grouped_matmul_reference
rng = np.random.default_rng(0)
for fmt in ["int8", "int4"]:
    for dt in [jnp.float32, jnp.bfloat16]:
        m, k, n, g = 300, 512, 384, 128
        x = jnp.asarray(rng.normal(size=(m, k)), dt)
        w = jnp.asarray(rng.normal(size=(4, k, n)) / k**0.5, jnp.float32)
        qa = quant.quantize(w, fmt, contract=1, stack=1, group=g)
        sizes = jnp.array([100, 0, 150, 50], jnp.int32)
        try:
            out = quant_grouped_matmul(x, qa.q, qa.scale, sizes, fmt=fmt, group=g)
            ref = quant_grouped_matmul_reference(x, qa.q, qa.scale, sizes, fmt=fmt, group=g)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))) / jnp.max(jnp.abs(ref.astype(jnp.float32))))
            print("kernel", fmt, jnp.dtype(dt).name, "rel err vs jnp", err, "tail zero", bool(jnp.all(out[300:] == 0)))
        except Exception as e:
            print("kernel", fmt, jnp.dtype(dt).name, "FAILED", type(e).__name__, str(e)[:800])
    x = jnp.asarray(rng.normal(size=(64, 256)), jnp.float32)
    ex = jnp.asarray(rng.integers(0, 8, (64, 2)), jnp.int32); wt = jnp.asarray(rng.uniform(size=(64, 2)), jnp.float32)
    ws = [quant.quantize(jnp.asarray(rng.normal(size=s) / s[1]**0.5, jnp.float32), fmt, contract=1, stack=1) for s in ((8,256,128),(8,256,128),(8,128,256))]
    res = {}
    for impl in ["auto", "ragged", "tiled", "dense"]:
        try:
            res[impl] = jax.jit(lambda *a, impl=impl: dispatch.routed_experts(*a, impl=impl))(x, ex, wt, *ws)
        except Exception as e:
            print("dispatch", fmt, impl, "FAILED", type(e).__name__, str(e)[:800])
    for impl, y in res.items():
        print("dispatch", fmt, impl, "rel err vs dense", float(jnp.max(jnp.abs(y - res["dense"])) / jnp.max(jnp.abs(res["dense"]))))
# fp8 stored experts through the block-scaled kernel vs the dequantized reference with the fp8 recipe
from dsv3_jax.ops.linear import fp8_grouped_matmul_stored
w = jnp.asarray(rng.normal(size=(4, 256, 384)) / 16, jnp.float32)
qa = quant.quantize(w, "fp8", contract=1, stack=1)
x = jnp.asarray(rng.normal(size=(300, 256)), jnp.bfloat16)
sizes = jnp.array([100, 0, 150, 50], jnp.int32)
y = fp8_grouped_matmul_stored(x, qa.q, qa.scale, sizes, jnp.float32)
wd = quant.dequantize(qa, jnp.float32)
ends = np.cumsum([100, 0, 150, 50]); starts = ends - np.array([100, 0, 150, 50])
want = jnp.concatenate([x[s:e].astype(jnp.float32) @ wd[i] for i, (s, e) in enumerate(zip(starts, ends))])
print("fp8 stored grouped rel err vs dequantized bf16 matmul", float(jnp.max(jnp.abs(y[:300] - want)) / jnp.max(jnp.abs(want))))

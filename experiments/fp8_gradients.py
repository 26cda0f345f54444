"""Where FP8's gradient error comes from: the routed experts' mechanism, or the routing it feeds.

    python -m experiments.fp8_gradients --batch=16 --seq_len=128 [--weights=RUN_FOLDER]   # docs/fp8.md

One training batch of the `experiments.fp8_experiment` model (init weights, or a run's final
weights). The routed experts of every MoE layer are captured in an fp32 forward and backward:
their inputs (tokens x, top-k experts and weights, w1/w3/w2) and the cotangent of their output.

1. Fixed routing: the routed experts' VJP recomputed on exactly those tensors in bf16 (the tiled
   path) and in the FP8 recipe, each output and gradient's relative error against fp32 (dense).
   The e4m3 rounding of one operand is ~3.6% rms, so a GEMM of two quantised operands lands a few
   % from fp32 and the three chained GEMMs of SwiGLU a little more; far more would be a bug.
2. Whole model: the same batch and init weights in the bf16 and FP8 arms, how far each layer's
   expert inputs and cotangents already are from fp32's, and the share of top-k choices that differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import fp8_experiment  # noqa: F401  (its model; and its --batch, --seq_len flags)

_WEIGHTS = flags.DEFINE_string("weights", None, "A training run's folder for the fixed-routing check (default: init).")

ARMS = {"fp32": dict(compute_dtype="float32", moe_impl="dense"), "bf16": dict(compute_dtype="bfloat16"),
        "fp8": dict(compute_dtype="bfloat16", fp8_matmul=True)}
NAMES = ("y", "dx", "dw1", "dw3", "dw2")


def capture(overrides: dict, batch_rows: int, seq_len: int, weights: str | None = None) -> list[dict]:
    """Per routed-experts call (MoE layers in order, MTP's last): x, experts, weights, w1, w3, w2
    and g (the cotangent of its output) from one forward and backward of the training loss."""
    from flax import nnx

    from dsv3_jax import DeepSeekV3, load_pretrained
    from dsv3_jax.ops import dispatch
    from dsv3_jax.train import losses, state as state_lib
    from dsv3_jax.train.step import _forward, _model
    from experiments.fp8_experiment import run_config
    from experiments.train import make_data, model_config

    fwd, bwd, routed = [], [], dispatch.routed_experts

    @jax.custom_vjp
    def tap(y):
        return y

    def tap_bwd(_, g):
        jax.debug.callback(lambda g: bwd.append(np.asarray(g)), g)
        return (g,)

    tap.defvjp(lambda y: (y, None), tap_bwd)

    def recording(x, experts, weights_, w1, w3, w2, **kw):
        jax.debug.callback(lambda *a: fwd.append([np.asarray(t) for t in a]), x, experts, weights_, w1, w3, w2)
        return tap(routed(x, experts, weights_, w1, w3, w2, **kw))

    c = run_config("bf16", "", 1, batch_rows, seq_len)
    c.model.update(overrides)
    model = (load_pretrained(weights, **{"fp8_matmul": False, **overrides}) if weights
             else DeepSeekV3(model_config(c), rngs=nnx.Rngs(0)))
    graphdef, params, rest = state_lib.split_model(model)
    batch = next(make_data(c, c.model.vocab_size)[0])

    def loss(p, r):
        out, head = _forward(_model(graphdef, p, r), batch, with_mtp=True)
        return losses.training_losses(out, batch, mtp_weight=0.3, balance_weight=1e-4, head=head).total

    dispatch.routed_experts = recording
    try:
        jax.block_until_ready(jax.jit(jax.grad(loss))(nnx.to_pure_dict(params), nnx.to_pure_dict(rest)))
        jax.effects_barrier()
    finally:
        dispatch.routed_experts = routed
    keys = ("x", "experts", "weights", "w1", "w3", "w2")
    return [dict(zip(keys, f), g=g) for f, g in zip(fwd, bwd[::-1])]  # the backward visits layers in reverse


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def expert_vjp(layer: dict, impl: str, dtype) -> list[jax.Array]:
    """[y, dx, dw1, dw3, dw2] of the routed experts on the captured tensors, in `dtype` via `impl`."""
    from dsv3_jax.ops.dispatch import routed_experts

    def run(experts, weights, x, w1, w3, w2, g):
        f = lambda x, *ws: routed_experts(x, experts, weights, *ws, impl=impl)  # noqa: E731
        y, pull = jax.vjp(f, x, w1, w3, w2)
        return [y, *pull(g)]

    args = [jnp.asarray(layer[k]).astype(dtype) for k in ("x", "w1", "w3", "w2", "g")]
    return jax.jit(run)(jnp.asarray(layer["experts"]), jnp.asarray(layer["weights"]), *args)


def main(argv):
    del argv
    layers = capture(ARMS["fp32"], flags.FLAGS.batch, flags.FLAGS.seq_len, _WEIGHTS.value)
    print(f"fixed routing ({_WEIGHTS.value or 'init'} weights), relative error against fp32:")
    for i, layer in enumerate(layers):
        ref = expert_vjp(layer, "dense", jnp.float32)
        for arm, impl in (("bf16", "tiled"), ("fp8", "fp8")):
            got = expert_vjp(layer, impl, jnp.bfloat16)
            print(f"  MoE call {i} {arm}: " + ", ".join(f"{n} {100 * relative_error(a, b):.2f}%"
                                                      for n, a, b in zip(NAMES, got, ref)), flush=True)
    print("whole model (init weights): the routed experts' inputs against the fp32 arm's:")
    fp32 = capture(ARMS["fp32"], flags.FLAGS.batch, flags.FLAGS.seq_len)
    for arm in ("bf16", "fp8"):
        for i, (ours, ref) in enumerate(zip(capture(ARMS[arm], flags.FLAGS.batch, flags.FLAGS.seq_len), fp32)):
            flips = np.mean(np.sort(ours["experts"], -1) != np.sort(ref["experts"], -1))
            print(f"  MoE call {i} {arm}: x {100 * relative_error(ours['x'], ref['x']):.2f}%, "
                  f"g {100 * relative_error(ours['g'], ref['g']):.2f}%, top-k choices differing {100 * flips:.2f}%",
                  flush=True)


if __name__ == "__main__":
    app.run(main)

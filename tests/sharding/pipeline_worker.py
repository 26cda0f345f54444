"""The pipeline schedule against a plain scan over the same layers, on 8 fake CPU devices.

    python -m tests.sharding.pipeline_worker   # JSON lines: one per (stages, layers, microbatches)

The bubble is measured on the compiled program: the ticks the schedule executes (its
collective-permutes, one per tick, times the trip counts of the loops around them) and the
matmuls each device executes (two per layer application), against the matmuls the work needs
(2 L M / S per device).
"""

import json
import os
import re

from tests.helpers import fake_device_flags

os.environ.setdefault("XLA_FLAGS", fake_device_flags(8, fast_compile=True))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sharding  # noqa: E402
from sharding import pipeline  # noqa: E402

D, H, MB = 8, 16, 4


def layer(p, x, side):
    """A residual MLP reading a per-microbatch side input; its aux output is the input's mean."""
    return x + jnp.tanh((x + side) @ p["w1"]) @ p["w2"], jnp.mean(x)


def sequential(stacked, xs, side):
    """Every microbatch through the layers in order: (y [M, ...], aux [L, M])."""
    def one(x, e):
        return jax.lax.scan(lambda h, p: layer(p, h, e), x, stacked)

    y, aux = jax.vmap(one)(xs, side)
    return y, aux.T


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CALLED = re.compile(r"(?:calls|to_apply|body)=%?([\w.\-]+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_TRIP = re.compile(r"known_trip_count[^0-9]*(\d+)")


def executed(hlo: str, opcode: str) -> int:
    """How many times a device runs `opcode` in compiled HLO text: each computation's own
    instructions, plus those of the computations it calls, a while body's times its trip count."""
    comps, entry, name = {}, None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            name, comps[m.group(1)] = m.group(1), []
            entry = name if line.startswith("ENTRY") else entry
        elif name is not None and line.startswith(" "):
            comps[name].append(line)

    def count(comp: str) -> int:
        total = 0
        for line in comps.get(comp, []):
            total += bool(re.search(rf"\s{opcode}\(", line))
            body = _BODY.search(line) if " while(" in line else None
            for called in _CALLED.findall(line):
                trip = _TRIP.search(line) if body and called == body.group(1) else None
                total += count(called) * (int(trip.group(1)) if trip else 1)
        return total

    return count(entry)


def main():
    rng = np.random.default_rng(0)
    # (stages, layers, microbatches, repeats, schedule): GPipe even / uneven / one microbatch, circular,
    # then the hand-run backwards: 1F1B uneven / even, DualPipeV (2S chunks) even / uneven.
    for stages, layers, micro, repeats, schedule in (
            (4, 6, 8, 1, "gpipe"), (2, 5, 4, 1, "gpipe"), (4, 4, 1, 1, "gpipe"), (4, 8, 4, 2, "circular"),
            (2, 5, 3, 2, "circular"), (4, 6, 8, 2, "circular"), (4, 6, 8, 1, "1f1b"), (2, 4, 3, 1, "1f1b"),
            (2, 8, 5, 1, "dualpipev"), (4, 6, 8, 1, "dualpipev")):
        mesh = sharding.make_mesh({"pipeline": stages, "data": -1})
        stacked = {"w1": jnp.asarray(rng.standard_normal((layers, D, H)) * 0.3, jnp.float32),
                   "w2": jnp.asarray(rng.standard_normal((layers, H, D)) * 0.3, jnp.float32)}
        xs = jnp.asarray(rng.standard_normal((micro, MB, D)), jnp.float32)
        side = jnp.asarray(rng.standard_normal((micro, 1, D)), jnp.float32)

        def piped(stacked, xs, side):
            return pipeline.pipeline_apply(layer, stacked, xs, side, mesh=mesh, repeats=repeats, schedule=schedule)

        def loss(f):
            def total(s, x, e):
                y, aux = f(s, x, e)[:2]
                return jnp.sum(jnp.sin(y)) + jnp.sum(aux ** 2)
            return total

        compiled = jax.jit(piped).lower(stacked, xs, side).compile()
        out, aux = compiled(stacked, xs, side)
        ref, aux_ref = jax.jit(sequential)(stacked, xs, side)
        wrt = (0, 1, 2) if repeats > 1 or schedule == "gpipe" else (0, 1)  # hand-run backwards: side is constant
        grad = jax.jit(jax.grad(loss(piped), argnums=wrt))
        g = grad(stacked, xs, side)
        g_ref = jax.jit(jax.grad(loss(sequential), argnums=wrt))(stacked, xs, side)
        grad_rel = max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
                       for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)))
        hlo = compiled.as_text()
        matmuls = executed(hlo, "dot")  # two per layer application, padding slots and idle ticks included
        grad_hlo = grad.lower(stacked, xs, side).compile().as_text()
        print(json.dumps({"stages": stages, "layers": layers, "microbatches": micro, "repeats": repeats,
                          "schedule": schedule, "grad_handoffs": executed(grad_hlo, "collective-permute"),
                          "out_rel": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
                          "aux_rel": float(np.linalg.norm(aux - aux_ref) / np.linalg.norm(aux_ref)), "grad_rel": grad_rel,
                          "ticks": executed(hlo, "collective-permute"),
                          # (None when the layers run in conditionals, DualPipeV's: not counted here)
                          "bubble_measured": 1.0 - 2 * layers * micro / stages / matmuls if matmuls else None,
                          "bubble_theory": pipeline.bubble_fraction(stages, micro, repeats),
                          "ppermute": "collective-permute" in hlo}), flush=True)


if __name__ == "__main__":
    main()

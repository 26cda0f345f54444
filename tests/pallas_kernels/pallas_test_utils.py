"""Helpers for the pallas_kernels tests (imported by module name; tests/ is not a package)."""

import jax

# (kernel style, platform given to `lower(lowering_platforms=...)`)
LOWERINGS = [("tpu", "tpu"), ("triton", "cuda")]


def lowers(fn, args, platform):
  """`jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))`; raises on failure."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))

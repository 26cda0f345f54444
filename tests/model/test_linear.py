"""`ops.linear.project`'s plain path: the 2-D matmul (CPU) and the dot over the axes (TPU/GPU).

Both forms against numpy's einsum, values and the gradients of a weighted sum (whose weight
gradient is x^T c over every leading axis, and input gradient c w^T), for a projection contracting
one axis (w1: [B, T, D] x [D, F]) and one contracting two (an output projection [B, T, H, V] x [H, V, D]).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.ops import linear

CASES = {"contract 1": ((2, 5, 6), (6, 3, 4), 1), "contract 2": ((2, 5, 3, 4), (3, 4, 6), 2)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dot", [linear.dot_2d, linear.dot_over_axes, linear._plain_dot], ids=["2d", "axes", "auto"])
def test_plain_dot_matches_numpy(case, dot):
    x_shape, w_shape, contract = CASES[case]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    y_shape = x_shape[: len(x_shape) - contract] + w_shape[contract:]
    c = rng.standard_normal(y_shape).astype(np.float32)
    lead, kx = "abcd"[: len(x_shape) - contract], "klm"[:contract]
    out = "nop"[: len(w_shape) - contract]
    y_ref = np.einsum(f"{lead}{kx},{kx}{out}->{lead}{out}", x, w)
    dx_ref = np.einsum(f"{lead}{out},{kx}{out}->{lead}{kx}", c, w)
    dw_ref = np.einsum(f"{lead}{kx},{lead}{out}->{kx}{out}", x, c)

    y = jax.jit(lambda x, w: dot(x, w, contract))(x, w)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(dot(x, w, contract) * c), argnums=(0, 1)))(x, w)
    assert y.shape == y_shape and y.dtype == jnp.float32
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)

"""Next-token negative log-likelihood with a one-pass backward.

Letters: N tokens (any leading shape), V vocab.

nll = logsumexp(z) - z[target]; d nll / dz = softmax(z) - onehot(target).

Autodiff of `log_softmax` + `take_along_axis` writes the [N, V] gradient in several passes (a
scatter for the one-hot, the softmax term, their sum, and on XLA:CPU a second copy in the layout
the head's weight-gradient dot wants). The custom VJP below forms it in one elementwise pass from
the saved logits and the [N] log-normaliser, the same arithmetic in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def token_nll(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] in fp32, shape of `targets`. logits [..., V], targets int [...]."""
    return _forward(logits_NxV, targets_N)[0]


def _forward(logits, targets):
    z = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return lse - picked, lse


def _fwd(logits, targets):
    nll, lse = _forward(logits, targets)
    return nll, (logits, targets, lse)


def _bwd(res, g):
    logits, targets, lse = res
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    grad = g[..., None] * (probs - (vocab_ids == targets[..., None]).astype(jnp.float32))
    return grad.astype(logits.dtype), None


token_nll.defvjp(_fwd, _bwd)

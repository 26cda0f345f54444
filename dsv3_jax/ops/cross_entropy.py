"""Next-token negative log-likelihood with a one-pass backward.

Letters: N tokens (any leading shape), V vocab.

nll = logsumexp(z) - z[target]; d nll / dz = softmax(z) - onehot(target).

Autodiff of `log_softmax` + `take_along_axis` writes the [N, V] gradient in several passes (a
scatter for the one-hot, the softmax term, their sum, and on XLA:CPU a second copy in the layout
the head's weight-gradient dot wants). The custom VJP below forms it in one elementwise pass from
the saved logits and the [N] log-normaliser, the same arithmetic in fp32. `nll_and_lse` and
`nll_grad` are its two halves, which the fused head loss (ops/head_loss.py) calls on each chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def token_nll(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] in fp32, shape of `targets`. logits [..., V], targets int [...]."""
    return nll_and_lse(logits_NxV, targets_N)[0]


def nll_and_lse(logits_NxV: jax.Array, targets_N: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(-log softmax(logits)[target], logsumexp(logits)), both fp32 [...]."""
    z = logits_NxV.astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets_N[..., None], axis=-1)[..., 0]
    return lse - picked, lse


def nll_grad(logits_NxV: jax.Array, targets_N: jax.Array, lse_N: jax.Array, g_N: jax.Array) -> jax.Array:
    """g * d nll / d logits = g (softmax(logits) - onehot(target)) in one pass, fp32 [..., V]."""
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits_NxV.shape, logits_NxV.ndim - 1)
    probs = jnp.exp(logits_NxV.astype(jnp.float32) - lse_N[..., None])
    return g_N[..., None] * (probs - (vocab_ids == targets_N[..., None]).astype(jnp.float32))


def _fwd(logits, targets):
    nll, lse = nll_and_lse(logits, targets)
    return nll, (logits, targets, lse)


def _bwd(res, g):
    logits, targets, lse = res
    return nll_grad(logits, targets, lse, g).astype(logits.dtype), None


token_nll.defvjp(_fwd, _bwd)

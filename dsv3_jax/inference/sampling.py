"""Next-token choice: greedy, or sampling with temperature, top-k and top-p (nucleus).

Order as in HF transformers: logits / temperature, then keep the top-k, then keep the smallest
set of the most likely remaining tokens whose probability reaches top_p. Ties at a threshold are
kept (thresholds are on values). Letters: B batch, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy (argmax), top_k / top_p ignored
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] or be None, got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logits(logits_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """float32 logits / temperature with tokens outside top-k / top-p set to -inf."""
    x = logits_BxV.astype(jnp.float32) / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, -jnp.inf)
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_desc = -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = mass_before < cfg.top_p  # the first token always stays
        threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= threshold, x, -jnp.inf)
    return x


def probabilities(logits_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The distribution `sample` draws from, float32 [..., V] (one-hot argmax when greedy)."""
    if cfg.greedy:
        return jax.nn.one_hot(jnp.argmax(logits_BxV, axis=-1), logits_BxV.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(filtered_logits(logits_BxV, cfg), axis=-1)


def sample(logits_BxV: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """int32 [...] next tokens; deterministic for a given key."""
    if cfg.greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits_BxV, cfg), axis=-1).astype(jnp.int32)

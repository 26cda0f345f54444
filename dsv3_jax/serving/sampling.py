"""Per-row sampling: every slot of the batch has its own temperature, top-k, top-p, seed and penalties,
and all rows are sampled inside the one compiled decode step.

Penalties (vLLM's and OpenAI's, in vLLM's order, on fp32 logits before temperature): the repetition
penalty r divides a positive logit by r and multiplies a negative one by r, for every token seen in
the prompt or the output; then each token's logit moves by its logit_bias, minus frequency_penalty
times its count in the output, minus presence_penalty if it occurs there; tokens banned by
min_tokens get -inf. A row carries these as a sparse table of P columns (token id, additive term,
repetition factor; unused columns id 0, 0, 1), kept on the host by `penalties.PenaltyTables`, so a
step ships [B, P] values (P ~ context length), not [B, V].

The rule is `dsv3_jax.inference.sampling`'s (HF order: logits / temperature, keep the top-k, then
the smallest most-likely set whose mass reaches top_p; ties at a threshold kept), with the scalars
turned into [B] arrays. Temperature 0 is greedy (argmax). top_k 0 and top_p 1 switch those filters
off. A row's key is fold_in(key(seed), position), so a request's draws do not depend on which
other requests share the batch. Letters: B batch (slots), V vocab.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class RowSampling(NamedTuple):
    """Sampling parameters of every slot, [B] arrays (numpy on the host, jax inside the step)."""

    temperature: np.ndarray  # float32, 0 = greedy
    top_k: np.ndarray  # int32, 0 = off
    top_p: np.ndarray  # float32 in (0, 1], 1 = off
    seed: np.ndarray  # uint32
    penalty_ids: np.ndarray | None = None  # int32 [B, P]: token of each penalty column (None: no penalties)
    penalty_add: np.ndarray | None = None  # float32 [B, P]: bias - frequency * count - presence (-inf: banned)
    penalty_scale: np.ndarray | None = None  # float32 [B, P]: repetition penalty r of a seen token, else 1

    @classmethod
    def greedy(cls, batch: int, width: int = 0) -> "RowSampling":
        """Greedy rows without penalties; `width` > 0 gives them empty penalty tables of that many columns."""
        tables = (np.zeros((batch, width), np.int32), np.zeros((batch, width), np.float32),
                  np.ones((batch, width), np.float32)) if width else (None, None, None)
        return cls(np.zeros(batch, np.float32), np.zeros(batch, np.int32), np.ones(batch, np.float32),
                   np.zeros(batch, np.uint32), *tables)

    def scalars(self) -> "RowSampling":
        """The [B] parameters only (the penalties already applied to the logits)."""
        return RowSampling(self.temperature, self.top_k, self.top_p, self.seed)

    def set_row(self, row: int, *, temperature: float, top_k: int, top_p: float, seed: int) -> None:
        self.temperature[row], self.top_k[row], self.top_p[row], self.seed[row] = temperature, top_k, top_p, seed


def penalized_logits(logits_BxxV: jax.Array, s: RowSampling) -> jax.Array:
    """float32 logits [B, V] or [B, K, V] with each row's penalties applied (the module docstring)."""
    x = logits_BxxV.astype(jnp.float32)
    if s.penalty_ids is None:
        return x
    b, v = x.shape[0], x.shape[-1]
    rows = jnp.arange(b)[:, None]
    scale = jnp.ones((b, v), jnp.float32).at[rows, s.penalty_ids].multiply(s.penalty_scale)
    add = jnp.zeros((b, v), jnp.float32).at[rows, s.penalty_ids].add(s.penalty_add)
    if x.ndim == 3:
        scale, add = scale[:, None], add[:, None]
    return jnp.where(x > 0, x / scale, x * scale) + add


def filtered_logits(logits_BxV: jax.Array, s: RowSampling) -> jax.Array:
    """float32 logits / temperature with each row's tokens outside its top-k / top-p set to -inf."""
    v = logits_BxV.shape[-1]
    t = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    x = logits_BxV.astype(jnp.float32) / t
    k = jnp.where((s.top_k > 0) & (s.top_k < v), s.top_k, v)
    kth = jnp.take_along_axis(-jnp.sort(-x, axis=-1), (k - 1)[:, None], axis=-1)
    x = jnp.where(x >= kth, x, -jnp.inf)
    sorted_desc = -jnp.sort(-x, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = (mass_before < s.top_p[:, None]) | (s.top_p[:, None] >= 1)  # the first token always stays
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x >= threshold, x, -jnp.inf)


def row_keys(seed_B: jax.Array, positions_B: jax.Array) -> jax.Array:
    """One key per row from its request's seed and the position of the token being drawn."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed_B, positions_B)


def sample_rows(logits_BxV: jax.Array, s: RowSampling, positions_B: jax.Array) -> jax.Array:
    """int32 [B] next tokens: argmax for greedy rows, a draw from the filtered distribution otherwise."""
    keys = row_keys(s.seed, positions_B)
    drawn = jax.vmap(lambda key, x: jax.random.categorical(key, x))(keys, filtered_logits(logits_BxV, s))
    greedy = jnp.argmax(logits_BxV, axis=-1)
    return jnp.where(s.temperature > 0, drawn, greedy).astype(jnp.int32)


MAX_LOGPROBS = 20  # OpenAI's ceiling for `logprobs` / `top_logprobs`: every step returns this many


class TokenLogprobs(NamedTuple):
    """float32 log-probabilities of chosen tokens and the most likely alternatives, shapes [..] / [.., N]."""

    chosen: jax.Array  # log p(token) of the token at each position
    top_ids: jax.Array  # int32: the N most likely tokens, most likely first
    top: jax.Array  # their log-probabilities


def token_logprobs(logits_xV: jax.Array, tokens_x: jax.Array, temperature_x: jax.Array) -> TokenLogprobs:
    """Log-probabilities (fp32) of `tokens` under the distribution a row samples from: logits / its
    temperature (1 for greedy rows), before the top-k / top-p cut, as vLLM reports them."""
    t = jnp.where(temperature_x > 0, temperature_x, 1.0)[..., None]
    lp = jax.nn.log_softmax(logits_xV.astype(jnp.float32) / t, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens_x[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top, ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, lp.shape[-1]))
    return TokenLogprobs(chosen, ids.astype(jnp.int32), top)

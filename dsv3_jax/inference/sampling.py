"""Next-token choice for `generate()` and the serving engine alike: one rule, one sampler.

Per row (every row its own parameters, [B] arrays in `RowSampling`; `generate()`'s one
`SamplingConfig` is broadcast to all rows):

1. Penalties (serving; vLLM's and OpenAI's, in vLLM's order, on fp32 logits): the repetition
   penalty r divides a positive logit by r and multiplies a negative one by r, for every token seen
   in the prompt or the output; then each token's logit moves by its logit_bias, minus
   frequency_penalty times its count in the output, minus presence_penalty if it occurs there;
   tokens banned by min_tokens get -inf. A row carries these as a sparse table of P columns (token
   id, additive term, repetition factor; unused columns id 0, 0, 1), kept on the host by
   `dsv3_jax.serving.penalties`, so a step ships [B, P] values (P ~ context length), not [B, V].
2. HF's order: logits / temperature, keep the top-k, then the smallest most-likely set whose mass
   reaches top_p (ties at a threshold kept). Temperature 0 is greedy (argmax of the penalized
   logits); top_k 0 and top_p 1 switch those filters off.
3. A grammar (serving's structured outputs, `dsv3_jax.serving.grammar`): tokens the row's bitmask
   forbids get -inf; a free row's bitmask allows every token, so free and constrained rows share
   one compiled step.
4. A draw with the row's key: in the engine fold_in(key(seed), position), so a request's draws do
   not depend on which other requests share the batch; in `generate()` a split of the step's key.

Log-probabilities (`token_logprobs`) are of step 1's logits / temperature, fp32, as vLLM reports
them (before the grammar). Letters: B batch (rows, slots), V vocab, G = ceil(V / 32) grammar bitmask words.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """generate()'s settings, one for every row."""

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

    def draw_with(self, key: jax.Array, batch: int) -> "Draw":
        """generate()'s draw: these settings for every one of `batch` rows, the rows keyed by splitting `key`;
        whether the rows are greedy and which filters are on is known when tracing."""
        rows = RowSampling(jnp.full(batch, self.temperature, jnp.float32), jnp.full(batch, self.top_k or 0, jnp.int32),
                           jnp.full(batch, self.top_p or 1.0, jnp.float32), jnp.zeros(batch, jnp.uint32))
        filters = self.top_k is not None, self.top_p is not None and self.top_p < 1
        return Draw(rows, jax.random.split(key, batch), self.temperature == 0, filters)


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

    def draw_at(self, positions_B: jax.Array) -> "Draw":
        """The engine's draw: row b keyed by (its request's seed, the position of the token drawn), so
        its draws do not depend on the other rows of the batch."""
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(self.seed, positions_B)
        return Draw(self, keys)

    def scalars(self) -> tuple:
        """The [B] parameters (temperature, top_k, top_p, seed), without the penalty tables."""
        return self.temperature, self.top_k, self.top_p, self.seed

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


def allowed_tokens(bitmask_xG: jax.Array, vocab: int) -> jax.Array:
    """bool [.., V]: token v is allowed when bit v % 32 of int32 word v // 32 is set (llguidance's layout)."""
    bits = (bitmask_xG[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(*bitmask_xG.shape[:-1], -1)[..., :vocab].astype(bool)


def constrained_logits(logits_xV: jax.Array, bitmask_xG: jax.Array | None) -> jax.Array:
    """The logits with the tokens a grammar forbids at -inf (step 3); None: no grammar in this step."""
    if bitmask_xG is None:
        return logits_xV
    return jnp.where(allowed_tokens(bitmask_xG, logits_xV.shape[-1]), logits_xV, -jnp.inf)


def filtered_logits(logits_BxV: jax.Array, s: RowSampling, *, top_k: bool = True, top_p: bool = True
                    ) -> jax.Array:
    """float32 logits / temperature with each row's tokens outside its top-k / top-p set to -inf.
    `top_k` / `top_p` False: no row uses that filter (skips its sort; known when tracing)."""
    v = logits_BxV.shape[-1]
    t = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    x = logits_BxV.astype(jnp.float32) / t
    if top_k:
        k = jnp.where((s.top_k > 0) & (s.top_k < v), s.top_k, v)
        kth = jnp.take_along_axis(-jnp.sort(-x, axis=-1), (k - 1)[:, None], axis=-1)
        x = jnp.where(x >= kth, x, -jnp.inf)
    if not top_p:
        return x
    sorted_desc = -jnp.sort(-x, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = (mass_before < s.top_p[:, None]) | (s.top_p[:, None] >= 1)  # the first token always stays
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x >= threshold, x, -jnp.inf)


class Draw(NamedTuple):
    """How a step draws: every row's parameters and key. `greedy` (no row samples: no distribution
    is computed) and `filters` (top_k, top_p: whether any row uses each) are known when tracing."""

    rows: RowSampling
    keys: jax.Array  # [B]: in the engine from (seed, position), in generate() split from the step's key
    greedy: bool = False
    filters: tuple[bool, bool] = (True, True)


def draw(logits_BxV: jax.Array, d: Draw) -> jax.Array:
    """int32 [B] next tokens: argmax for greedy rows, else a draw with row b's key from its filtered
    distribution. The one sampler of generate() and the engine."""
    greedy = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    if d.greedy:
        return greedy
    top_k, top_p = d.filters
    x = filtered_logits(logits_BxV, d.rows, top_k=top_k, top_p=top_p)
    drawn = jax.vmap(lambda key, x: jax.random.categorical(key, x))(d.keys, x)
    return jnp.where(d.rows.temperature > 0, drawn, greedy).astype(jnp.int32)


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

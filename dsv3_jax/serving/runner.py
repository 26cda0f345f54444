"""The engine's only door into the model: a latent cache of `max_batch` slots, chunked prefill of one
prompt into one slot's rows, and one decode step over every slot at its own position.

Letters: B slots (max_batch), S cache length (max_seq_len), W chunk length, V vocab, L layers, E experts.

All model math is `dsv3_jax.inference.decode.model_step`, the same step `generate()` runs:
  * the first chunk of a prompt (window starting at position 0) takes the model's own MLA, as
    `generate()`'s prefill does;
  * later chunks and the decode step take absorbed attention over the cache, causal by position.
Only the slot's rows [1, S] of the cache are cut out for a prefill chunk and written back, so the
other slots' rows are never touched. The cache holds stale entries at positions a row has not
reached; attention never reads them (see `dsv3_jax.inference.cache`), so a freed slot needs no
clearing and idle rows of the decode step may write anywhere at or past their frontier.

Compilation: the decode step once per (B, S); a prefill chunk once per (W bucket, first or not),
W a power of two up to `chunk`. Every function is pure in (state, cache, ...) and donates the cache.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv3_jax.inference.cache import CACHE_DTYPES, init_cache
from dsv3_jax.inference.decode import model_step
from dsv3_jax.serving.sampling import RowSampling, sample_rows


class StepResult(NamedTuple):
    tokens: np.ndarray  # int32 [B]: the next token of every slot (meaningless for idle slots)
    expert_counts: np.ndarray | None  # float32 [L_moe, E]: tokens of active slots routed per expert


def chunk_buckets(chunk: int) -> tuple[int, ...]:
    """Chunk lengths a prefill compiles for: powers of two from 16 up to `chunk`."""
    out, w = [], 16
    while w < chunk:
        out.append(w)
        w *= 2
    return (*out, chunk)


def _rows(cache, slot):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1), cache)


def _put_rows(cache, rows, slot):
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=1), cache, rows)


class Runner:
    """Owns the model state and the cache; the engine calls `prefill_chunk` and `decode`."""

    def __init__(self, model, *, max_batch: int, max_seq_len: int, cache_dtype: str | None = None,
                 chunk: int = 64):
        cfg = model.config
        cache_dtype = cache_dtype or cfg.compute_dtype
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_dtype!r}")
        if not 2 <= max_seq_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len must lie in [2, max_position_embeddings={cfg.max_position_embeddings}], "
                             f"got {max_seq_len}")
        if max_batch < 1 or chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"max_batch must be >= 1 and chunk a power of two, got {max_batch=}, {chunk=}")
        self.config, self.max_batch, self.max_seq_len, self.chunk = cfg, max_batch, max_seq_len, chunk
        self.cache_dtype, self.buckets = cache_dtype, chunk_buckets(chunk)
        graphdef, self.state = nnx.split(model)
        # committed to a device, as every step's output is: one compiled step for both
        self.cache = jax.device_put(init_cache(cfg, max_batch, max_seq_len, cache_dtype), jax.devices()[0])
        self._prefill, self._decode = _compiled(graphdef, cache_dtype, max_seq_len)

    def chunks(self, length: int) -> list[tuple[int, int, int]]:
        """(start, valid, padded width) of each chunk of a `length`-token prompt."""
        out = []
        for start in range(0, length, self.chunk):
            valid = min(self.chunk, length - start)
            out.append((start, valid, next(w for w in self.buckets if w >= valid)))
        return out

    def prefill_chunk(self, slot: int, tokens: np.ndarray, start: int, width: int, sampling: RowSampling
                      ) -> int:
        """Writes `tokens` (positions start ..) into the slot's rows; returns the token that would
        follow the last one (sampled with the slot's row of `sampling`; the caller keeps it only
        after a prompt's last chunk)."""
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(tokens)] = tokens
        row = RowSampling(*(a[slot:slot + 1] for a in sampling))
        token, self.cache = self._prefill[start == 0](self.state, self.cache, jnp.asarray(padded), np.int32(slot),
                                                      np.int32(start), np.int32(len(tokens)), row)
        return int(token[0])

    def decode(self, tokens_B: np.ndarray, positions_B: np.ndarray, active_B: np.ndarray,
               sampling: RowSampling) -> StepResult:
        """One step: slot b feeds tokens[b] at positions[b] and gets its next token."""
        tokens, counts, self.cache = self._decode(self.state, self.cache, jnp.asarray(tokens_B, jnp.int32),
                                                  jnp.asarray(positions_B, jnp.int32), jnp.asarray(active_B),
                                                  sampling)
        return StepResult(np.asarray(tokens), None if counts is None else np.asarray(counts))

    def warm_up(self) -> None:
        """Compiles every prefill bucket and the decode step (on slot 0, whose rows hold nothing yet)."""
        greedy = RowSampling.greedy(self.max_batch)
        for w in self.buckets:
            for start in (0, w):
                if start + w < self.max_seq_len:
                    self.prefill_chunk(0, np.zeros(w, np.int32), start, w, greedy)
        zeros = np.zeros(self.max_batch, np.int32)
        self.decode(zeros, zeros, np.zeros(self.max_batch, bool), greedy)


@functools.lru_cache(maxsize=8)
def _compiled(graphdef, cache_dtype: str, max_seq_len: int):
    def prefill(first: bool, state, cache, tokens_1xW, slot, start, valid, sampling):
        model = nnx.merge(graphdef, state)
        w = tokens_1xW.shape[1]
        index = jnp.arange(w, dtype=jnp.int32)[None]
        positions = jnp.minimum(start + index, max_seq_len - 1)  # padding writes stay inside the cache
        out = model_step(model, _rows(cache, slot), tokens_1xW, positions, prefill=first, cache_dtype=cache_dtype,
                         token_mask_BxW=index < valid)
        last = jax.lax.dynamic_index_in_dim(out.logits[0], valid - 1, keepdims=True)  # [1, V]
        token = sample_rows(last, sampling, (start + valid)[None])
        return token, _put_rows(cache, out.cache, slot)

    def decode(state, cache, tokens_B, positions_B, active_B, sampling):
        model = nnx.merge(graphdef, state)
        out = model_step(model, cache, tokens_B[:, None], positions_B[:, None], prefill=False,
                         cache_dtype=cache_dtype, token_mask_BxW=active_B[:, None])
        token = sample_rows(out.logits[:, 0], sampling, positions_B + 1)
        counts = None if out.router_stats is None else out.router_stats.expert_counts
        return token, counts, out.cache

    jit_prefill = {first: jax.jit(functools.partial(prefill, first), donate_argnums=1) for first in (True, False)}
    return jit_prefill, jax.jit(decode, donate_argnums=1)

"""Autoregressive generation: one prefill pass, then one compiled decode step reused for every token.

Output layout (ragged batches): prompts are right-padded, row b's prompt is prompts[b, :lengths[b]].
The result is int32 [B, T + max_new_tokens]; row b holds its prompt, then its generated tokens from
index lengths[b], then `pad_id`. A row stops after its first stop token (kept); later slots are
`pad_id`. Positions are 0 .. lengths[b] - 1 for the prompt, as in training.

Compilation: the cache length is a power-of-two bucket of T + max_new_tokens (+ drafts), so the
decode step compiles once per (batch, bucket, options) and is reused across tokens and calls.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv3_jax.inference import speculative
from dsv3_jax.inference.cache import CACHE_DTYPES, bucket_slots, init_cache
from dsv3_jax.inference.decode import TRACE_COUNTS, model_step
from dsv3_jax.inference.sampling import SamplingConfig, sample
from dsv3_jax.model.transformer import check_tokens


@dataclasses.dataclass
class GenerateStats:
    prefill_seconds: float = 0.0  # compile included on a first call
    first_step_seconds: float = 0.0  # the first decode step (compile included on a first call)
    decode_seconds: float = 0.0  # the decode steps after the first
    timed_tokens: int = 0  # tokens kept by those steps
    forwards: int = 0  # decode steps after the prefill (each one forward of the main model)
    generated_tokens: int = 0  # kept tokens, all rows
    row_steps: int = 0  # decode steps summed over the rows still generating
    step_tokens: int = 0  # tokens those row-steps produced (before truncation at the end)
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    prompt_expert_counts: np.ndarray | None = None  # float32 [L_moe, E] routed prompt tokens per expert

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.step_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.timed_tokens / self.decode_seconds if self.decode_seconds else 0.0


class StepTokens(NamedTuple):
    """New tokens of one step: row b gained tokens[b, :counts[b]]."""

    tokens: np.ndarray  # int32 [B, K]
    counts: np.ndarray  # int32 [B]


def _constrain(tree, sharding):
    if sharding is None:
        return tree
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), tree)


@functools.lru_cache(maxsize=32)
def _compiled(graphdef, kind: str, sampling: SamplingConfig, cache_dtype: str, cache_sharding):
    """Jitted steps, pure in (state, cache, tokens, positions, key); cached so calls reuse them."""

    def prefill(state, cache, prompts, lengths, key):
        TRACE_COUNTS[f"{kind}_prefill"] += 1
        model = nnx.merge(graphdef, state)
        if kind == "mtp":
            first, nxt, stats, cache = speculative.prefill(model, cache, prompts, lengths, key, sampling=sampling,
                                                           cache_dtype=cache_dtype)
        else:
            b, t = prompts.shape
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            out = model_step(model, cache, prompts, positions, prefill=True, cache_dtype=cache_dtype,
                             token_mask_BxW=positions < lengths[:, None])
            first = sample(out.logits[jnp.arange(b), lengths - 1], key, sampling)
            nxt, stats, cache = first[:, None], out.router_stats, out.cache
        counts = None if stats is None else stats.expert_counts
        return first, nxt, counts, _constrain(cache, cache_sharding)

    def decode(state, cache, tokens, positions, key):
        TRACE_COUNTS[f"{kind}_decode"] += 1
        model = nnx.merge(graphdef, state)
        if kind == "mtp":
            emitted, accepted, nxt, cache = speculative.step(model, cache, tokens, positions, key, sampling=sampling,
                                                             cache_dtype=cache_dtype)
            return emitted, accepted, nxt, _constrain(cache, cache_sharding)
        out = model_step(model, cache, tokens, positions[:, None], prefill=False, cache_dtype=cache_dtype)
        token = sample(out.logits[:, 0], key, sampling)
        return token[:, None], jnp.zeros_like(positions), token[:, None], _constrain(out.cache, cache_sharding)

    return jax.jit(prefill, donate_argnums=1), jax.jit(decode, donate_argnums=1)


def _validate(model, prompts, max_new_tokens, lengths, stop_tokens, use_mtp, cache_dtype):
    cfg = model.config
    prompts = np.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be int token ids [batch, length] with length >= 1, got shape {prompts.shape}")
    b, t = prompts.shape
    lengths = np.full((b,), t, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if lengths.shape != (b,) or lengths.min() < 1 or lengths.max() > t:
        raise ValueError(f"lengths must be [batch={b}] ints in [1, {t}] (the padded prompt length), got {lengths}")
    valid = np.arange(t)[None] < lengths[:, None]
    check_tokens(jnp.asarray(np.where(valid, prompts, 0)), cfg.vocab_size)  # padding may hold anything
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if t + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {t} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    bad = [s for s in stop_tokens if not 0 <= int(s) < cfg.vocab_size]
    if bad:
        raise ValueError(f"stop_tokens {bad} lie outside [0, vocab_size={cfg.vocab_size})")
    if use_mtp and model.mtp is None:
        raise ValueError("use_mtp=True needs a model with MTP modules (config num_mtp_layers >= 1)")
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_dtype!r}")
    return prompts.astype(np.int32), lengths


class Generation:
    """Iterates StepTokens as they are produced; `output()` and `stats` once iteration has finished.

    See `generate` for the arguments; `param_shardings` (a pytree of shardings matching
    `nnx.state(model)`) and `cache_sharding` (one sharding for every cache array [L, B, S, ...])
    place the weights and the cache for sharded decoding.
    """

    def __init__(self, model, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, lengths=None, stop_tokens=(), use_mtp: bool = False,
                 pad_id: int = 0, cache_dtype: str | None = None, param_shardings=None, cache_sharding=None):
        cfg = model.config
        cache_dtype = cache_dtype or cfg.compute_dtype
        self.prompts, self.lengths = _validate(model, prompts, max_new_tokens, lengths, stop_tokens, use_mtp,
                                               cache_dtype)
        self.max_new_tokens, self.stop_tokens, self.pad_id = max_new_tokens, tuple(int(s) for s in stop_tokens), pad_id
        self.sampling = SamplingConfig(float(temperature), top_k, top_p)
        self.key = jax.random.key(seed)
        graphdef, state = nnx.split(model)
        self.state = state if param_shardings is None else jax.device_put(state, param_shardings)
        drafts = cfg.num_mtp_layers if use_mtp else 0
        b, t = self.prompts.shape
        cache = init_cache(cfg, b, bucket_slots(t + max_new_tokens + drafts), cache_dtype, with_mtp=use_mtp)
        self.cache = cache if cache_sharding is None else jax.device_put(cache, cache_sharding)
        self.prefill_fn, self.decode_fn = _compiled(graphdef, "mtp" if use_mtp else "plain", self.sampling,
                                                    cache_dtype, cache_sharding)
        self.stats = GenerateStats()
        self._out = np.full((b, t + max_new_tokens), pad_id, np.int32)
        self._out[:, :t] = np.where(np.arange(t)[None] < self.lengths[:, None], self.prompts, pad_id)
        self._count = np.zeros((b,), np.int32)
        self._done = np.zeros((b,), bool)

    def _keep(self, tokens_BxK: np.ndarray, n_BxK: np.ndarray) -> StepTokens:
        """Writes each active row's first n tokens, cut at max_new_tokens and after a stop token."""
        counts = np.zeros_like(self._count)
        for row in np.flatnonzero(~self._done):
            for tok in tokens_BxK[row, :min(n_BxK[row], self.max_new_tokens - self._count[row])]:
                self._out[row, self.lengths[row] + self._count[row]] = tok
                self._count[row] += 1
                counts[row] += 1
                if int(tok) in self.stop_tokens:
                    self._done[row] = True
                    break
            self._done[row] |= self._count[row] >= self.max_new_tokens
        self.stats.generated_tokens += int(counts.sum())
        return StepTokens(tokens_BxK, counts)

    def __iter__(self) -> Iterator[StepTokens]:
        start = time.perf_counter()
        first, tokens, expert_counts, self.cache = self.prefill_fn(
            self.state, self.cache, jnp.asarray(self.prompts), jnp.asarray(self.lengths), self.key)
        first = np.asarray(first)
        self.stats.prefill_seconds = time.perf_counter() - start
        if expert_counts is not None:
            self.stats.prompt_expert_counts = np.asarray(expert_counts)
        yield self._keep(first[:, None], np.ones_like(self._count))
        positions = self.lengths.copy()
        while not self._done.all():
            active, start = ~self._done, time.perf_counter()
            key = jax.random.fold_in(self.key, self.stats.forwards + 1)
            emitted, accepted, tokens, self.cache = self.decode_fn(self.state, self.cache, tokens,
                                                                   jnp.asarray(positions), key)
            emitted, accepted = np.asarray(emitted), np.asarray(accepted)
            seconds = time.perf_counter() - start
            self.stats.forwards += 1
            self.stats.row_steps += int(active.sum())
            self.stats.step_tokens += int((accepted + 1)[active].sum())
            self.stats.proposed_drafts += int(active.sum()) * (emitted.shape[1] - 1)
            self.stats.accepted_drafts += int(accepted[active].sum())
            # finished rows stay in the batch but stop advancing, so their slots stay in the bucket
            positions = np.where(active, positions + accepted + 1, positions).astype(np.int32)
            kept = self._keep(emitted, accepted + 1)
            if self.stats.forwards == 1:  # holds the compile on a first call: timed apart
                self.stats.first_step_seconds = seconds
            else:
                self.stats.decode_seconds += seconds
                self.stats.timed_tokens += int(kept.counts.sum())
            yield kept

    def output(self) -> np.ndarray:
        """int32 [B, T + max_new_tokens] in the layout of the module docstring."""
        return self._out


def generate(model, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, lengths=None, stop_tokens=(), use_mtp: bool = False,
             pad_id: int = 0, cache_dtype: str | None = None, return_stats: bool = False, **placement):
    """Generates up to `max_new_tokens` per row after int32 `prompts` [B, T].

    temperature 0 is greedy; otherwise samples (top_k, top_p as in `sampling`) reproducibly for a
    `seed`. `lengths` [B] gives ragged (right-padded) prompt lengths. `use_mtp` drafts with the MTP
    modules and verifies in one step (same tokens as without when greedy; same distribution when
    sampling). `cache_dtype` is "float32", "bfloat16" or "float8" (default: the compute dtype).
    Returns int32 [B, T + max_new_tokens] (layout in the module docstring) and, with
    `return_stats`, a GenerateStats (acceptance_rate, tokens_per_forward, timings).
    """
    gen = Generation(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     lengths=lengths, stop_tokens=stop_tokens, use_mtp=use_mtp, pad_id=pad_id,
                     cache_dtype=cache_dtype, **placement)
    for _ in gen:
        pass
    out = jnp.asarray(gen.output())
    return (out, gen.stats) if return_stats else out

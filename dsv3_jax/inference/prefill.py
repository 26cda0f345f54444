"""Chunked prefill: the prompt enters the cache a chunk at a time, each chunk attending to the cache
so far plus itself, so that memory grows with the cache, not with the prompt squared.

Letters: B batch, W chunk width, M MTP depths (0 without drafting), V vocab.

Chunk shapes: every chunk is `chunk` tokens wide, the last one padded, so a prompt of any length
is one chunk shape per (batch, cache bucket), and prompts shorter than a chunk share the smallest
cache bucket (a cache holds at least one padded chunk: `padded_end`). One width rather than a
power-of-two rest: each extra width is a compile per cache bucket, which costs more than the padded
tokens (benchmarks/bench_prefill_shapes.py). Padded tokens write entries past their row's length
that no later token reads before they are overwritten.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.inference.sampling import Draw, TokenLogprobs, constrained_logits, draw, penalized_logits, token_logprobs
from dsv3_jax.inference.speculative import mtp_draft
from dsv3_jax.model import ModelCache

DEFAULT_CHUNK = 512  # tokens per prefill chunk (a power of two): a short prompt pays one chunk


def check_chunk(chunk: int) -> None:
    if not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"prefill_chunk must be a power of two, got {chunk!r}")


def plan(length: int, chunk: int) -> list[tuple[int, int]]:
    """(start, width) of each chunk covering positions 0 .. length - 1."""
    check_chunk(chunk)
    return [(start, chunk) for start in range(0, max(int(length), 1), chunk)]


def padded_end(length: int, chunk: int) -> int:
    """One past the last position a prompt of `length` writes, padding included."""
    start, width = plan(length, chunk)[-1]
    return start + width


def window(prompts_BxT: np.ndarray, start: int, width: int, depths: int) -> np.ndarray:
    """Prompt tokens at positions start .. start + width + depths (zero past the prompt): the chunk
    and, one further, its next tokens for the MTP depths."""
    b, t = prompts_BxT.shape
    out = np.zeros((b, width + 1 + depths), np.int32)
    piece = prompts_BxT[:, start:start + width + 1 + depths]
    out[:, :piece.shape[1]] = piece
    return out


class PrefillCarry(NamedTuple):
    """What the chunks hand on: set by the chunk that holds a row's last prompt token."""

    first: jax.Array  # int32 [B] the first generated token
    drafts: jax.Array  # int32 [B, M] the MTP drafts that follow it
    expert_counts: jax.Array | None  # float32 [L_moe, E] prompt tokens routed per expert, summed


def init_carry(cfg, batch: int, depths: int) -> PrefillCarry:
    """Zeros on the host (numpy: nothing to compile)."""
    counts = np.zeros((cfg.num_moe_layers, cfg.num_routed_experts), np.float32) if cfg.num_moe_layers else None
    return PrefillCarry(np.zeros((batch,), np.int32), np.zeros((batch, depths), np.int32), counts)


def prefill_chunk(model, cache: ModelCache, window_BxN: jax.Array, start: jax.Array, lengths_B: jax.Array,
                  carry: PrefillCarry, d: Draw, *, logprobs: bool = False, bitmask_BxG: jax.Array | None = None
                  ) -> tuple[tuple[PrefillCarry, TokenLogprobs | None], ModelCache]:
    """One chunk of W tokens at positions start .. start + W - 1 (a `window`, W = N - 1 - M) of
    prompts `lengths_B` long; the first token is drawn among those `bitmask_BxG` allows (a grammar,
    `sampling.constrained_logits`). With `logprobs`, also the log-probabilities [B, W] of each
    position's next token (the prompt's, or at a row's last prompt token the sampled one)."""
    b, n = window_BxN.shape
    depths = 0 if cache.mtp is None else cache.mtp.latent.shape[0]
    width, slots = n - 1 - depths, cache.slots
    rows = jnp.arange(b)
    index = start + jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
    positions = jnp.minimum(index, slots - 1)  # padding writes stay inside the cache
    out = model.forward(window_BxN[:, :width], positions=positions, with_mtp=False, cache=cache,
                        token_mask=index < lengths_B[:, None])
    last = lengths_B - 1 - start  # the row's last prompt token, as an index into this chunk
    here = (last >= 0) & (last < width)
    last = jnp.clip(last, 0, width - 1)
    # Without logprobs, the head at each row's last token only: the chunk's other logits are never
    # read, and with them unused the compiled step drops the [B, W, V] head.
    logits_BxV = penalized_logits(out.logits[rows, last] if logprobs else model.logits(out.hidden[rows, last]),
                                  d.rows)
    first = jnp.where(here, draw(constrained_logits(logits_BxV, bitmask_BxG), d), carry.first)
    next_BxN = window_BxN[:, 1:].at[rows, last].set(jnp.where(here, first, window_BxN[rows, last + 1]))
    counts = carry.expert_counts
    if counts is not None:
        counts = counts + out.router_stats.expert_counts
    cache, drafts = out.cache, carry.drafts
    if cache.mtp is not None:
        new, cache = mtp_draft(model, cache, out.hidden, next_BxN, positions, last, active_B=here)
        drafts = jnp.where(here[:, None], new, drafts)
    lp = None
    if logprobs:  # the prompt's tokens by the model itself (none was sampled); the sampled one as drawn
        lp = token_logprobs(out.logits, next_BxN[:, :width], jnp.zeros((b, width), jnp.float32))
        drawn = token_logprobs(logits_BxV, first, d.rows.temperature)
        lp = TokenLogprobs(*(a.at[rows, last].set(jnp.where(here.reshape(-1, *[1] * (x.ndim - 1)), x, a[rows, last]))
                             for a, x in zip(lp, drawn)))
    return (PrefillCarry(first, drafts, counts), lp), cache

"""The inference core: the two compiled steps that `generate()` (one fixed batch) and the serving
runner (slots) both run, and the one cache of their compiled programs.

Letters: B rows the step runs, N rows of the whole cache, K = 1 + M tokens fed per row (M MTP
drafts, 0 without speculation), W chunk width, V vocab.

- `prefill.prefill_chunk`: one chunk of prompt tokens into the cache, the first token sampled at
  each row's last prompt token (and its MTP drafts).
- `decode_step`: every row feeds its last token (and its M drafts) at its own position; without
  MTP one token is sampled, with MTP the drafts are verified (`speculative.accept`) and drafted again.

Both take an optional grammar bitmask (int32, [B, G] for a prefill's sampled token, [B, K, G] for a
decode step's K outputs, G = ceil(V / 32); `sampling.constrained_logits`): the serving runner
always passes one (all bits set for free rows), `generate()` none.

Options of the one step (`StepOptions`, fixed when tracing): MTP, how rows sample (generate()'s
one `SamplingConfig` with keys split from the step's key, or the engine's per-row `RowSampling`
with penalties and keys from each request's seed and position), and log-probabilities.

Both steps are pure in (state, cache, ...), donate the cache, gather the rows `rows_N` they run
from the cache and scatter them back (all of them, in place, when rows_N covers the cache), and
return the cache in the sharding it came in (`cache_sharding`, on a mesh). All padding and position
arithmetic lives inside the steps or on the host in numpy: a prompt of a new length whose cache
bucket is compiled compiles nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsv3_jax.inference import prefill, speculative
from dsv3_jax.inference.sampling import (Draw, RowSampling, SamplingConfig, TokenLogprobs, constrained_logits, draw,
                                         penalized_logits, token_logprobs)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a compiled step computes (static)."""

    use_mtp: bool = False
    shared: SamplingConfig | None = None  # generate(): one setting for all rows; None: each row's RowSampling
    logprobs: bool = False  # return TokenLogprobs of the chosen (and, in a prefill, the prompt's) tokens


class StepOut(NamedTuple):
    emitted: jax.Array  # int32 [B, K]: row b's new tokens are emitted[b, :accepted[b] + 1]
    accepted: jax.Array  # int32 [B]: drafts accepted (0 without speculation)
    next_tokens: jax.Array  # int32 [B, K]: what each row feeds next (last token, drafts)
    expert_counts: jax.Array | None  # float32 [L_moe, E]: tokens of active rows routed per expert
    logprobs: TokenLogprobs | None  # [B, K] / [B, K, N] of emitted, with `logprobs`


def _constrain(cache, sharding):
    """The cache's stacks in `sharding` (on a mesh): what a step returns is what the next one takes.
    A page table, a host array each step, is left as it is."""
    if sharding is None:
        return cache
    stacks = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), cache._replace(page_table=None))
    return stacks._replace(page_table=cache.page_table)


def _draw(opts: StepOptions, sampling: RowSampling | None, key, positions_B: jax.Array) -> Draw:
    """Row parameters and keys of the tokens drawn at positions_B."""
    return sampling.draw_at(positions_B) if opts.shared is None else opts.shared.draw_with(key, positions_B.shape[0])


def decode_step(model, cache, tokens_BxK: jax.Array, positions_B: jax.Array, active_B: jax.Array, d: Draw, *,
                use_mtp: bool, logprobs: bool, bitmask_BxKxG: jax.Array | None = None):
    """Row b feeds tokens[b] at positions[b] ..; inactive rows count in no router statistics. Output i
    of row b draws (or verifies draft i + 1) among the tokens bitmask[b, i] allows: a draft the
    grammar forbids is rejected. Returns (StepOut, cache)."""
    b, k = tokens_BxK.shape
    positions_BxK = positions_B[:, None] + jnp.arange(k, dtype=jnp.int32)
    out = model.forward(tokens_BxK, positions=positions_BxK, with_mtp=False, cache=cache,
                        token_mask=jnp.broadcast_to(active_B[:, None], (b, k)))
    counts = None if out.router_stats is None else out.router_stats.expert_counts
    logits = penalized_logits(out.logits, d.rows)
    allowed = constrained_logits(logits, bitmask_BxKxG)
    if use_mtp:
        emitted, accepted = speculative.accept(allowed, tokens_BxK[:, 1:], d)
        # emitted[:, i] is the token at n + i + 1 for i <= accepted: the MTP's next-token input
        drafts, cache = speculative.mtp_draft(model, out.cache, out.hidden, jnp.pad(emitted, ((0, 0), (0, k - 1))),
                                  positions_BxK, accepted)
        nxt = jnp.concatenate([emitted[jnp.arange(b), accepted][:, None], drafts], axis=1)
    else:
        emitted = nxt = draw(allowed[:, 0], d)[:, None]
        accepted, cache = jnp.zeros_like(positions_B), out.cache
    lp = token_logprobs(logits, emitted, jnp.broadcast_to(d.rows.temperature[:, None], (b, k))) if logprobs else None
    return StepOut(emitted, accepted, nxt, counts, lp), cache


class Steps(NamedTuple):
    prefill: object  # jitted (state, cache, rows, window, start, lengths, carry, sampling, key[, bitmask])
    # -> ((carry, logprobs), cache)
    decode: object  # jitted (state, cache, rows, tokens, positions, active, sampling, key, step[, bitmask])
    # -> (StepOut, cache)
    traces: collections.Counter  # "prefill" / "decode": times each was traced, for this bundle only


def _take(cache, rows_N):
    # rows_N is every row, in order; or the cache is a pool of pages that its table's rows read in place
    whole = cache.page_table is not None or rows_N.shape[0] == jax.tree.leaves(cache)[0].shape[1]
    return whole, cache if whole else jax.tree.map(lambda a: jnp.take(a, rows_N, axis=1), cache)


def _put(cache, rows_N, whole, picked):
    return picked if whole else jax.tree.map(lambda a, r: a.at[:, rows_N].set(r), cache, picked)


@functools.lru_cache(maxsize=32)
def compiled(graphdef, opts: StepOptions, cache_sharding=None) -> Steps:
    """The jitted steps for a model graph and options; cached so calls and engines reuse them.
    `key` (and `step`) only with `opts.shared`, `sampling` only without."""
    traces = collections.Counter()

    def prefill_step(state, cache, rows_N, window_BxN, start, lengths_B, carry, sampling, key, bitmask_BxG=None):
        traces["prefill"] += 1
        d = _draw(opts, sampling, key, lengths_B)
        whole, picked = _take(cache, rows_N)
        out, picked = prefill.prefill_chunk(nnx.merge(graphdef, state), picked, window_BxN, start, lengths_B, carry,
                                            d, logprobs=opts.logprobs, bitmask_BxG=bitmask_BxG)
        return out, _constrain(_put(cache, rows_N, whole, picked), cache_sharding)

    def decode(state, cache, rows_N, tokens_BxK, positions_B, active_B, sampling, key, step, bitmask_BxKxG=None):
        traces["decode"] += 1
        key = None if key is None else jax.random.fold_in(key, step)  # in the step: no host dispatch per token
        d = _draw(opts, sampling, key, positions_B + 1)
        whole, picked = _take(cache, rows_N)
        out, picked = decode_step(nnx.merge(graphdef, state), picked, tokens_BxK, positions_B, active_B, d,
                                  use_mtp=opts.use_mtp, logprobs=opts.logprobs, bitmask_BxKxG=bitmask_BxKxG)
        return out, _constrain(_put(cache, rows_N, whole, picked), cache_sharding)

    return Steps(jax.jit(prefill_step, donate_argnums=1), jax.jit(decode, donate_argnums=1), traces)

"""The pipelined stack's whole-batch arrays kept split over the stages on the microbatch dimension.

Letters: S stages, M microbatches, B rows. Under the hand-run backwards (sharding/pipeline.py's
1f1b, sharding/dualpipev.py) the stack's input x, output y and their gradients are [M, ...]
batches that one stage reads or writes a microbatch at a time: the first stage reads x and writes
its gradient, the stage producing y (1F1B's last, DualPipeV's first) writes it and reads its
cotangent. Held whole on every stage they cost three [stage tokens, D] buffers per stage (the
README's plan of the paper's 2048-device run gives their size); split, M / S microbatches a stage, each microbatch moves between
its owner and the stage that needs it when it is needed (`StageBatch`). The model splits its batch
so that a stage's microbatches are rows it already holds (`split_stage_microbatches`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.stages import AXIS


def splits_stack_batch(schedule: str | None, num_microbatches: int, num_stages: int) -> bool:
    """Whether the stack's whole-batch arrays (its input, output, their gradients) stay split over
    the stages on the microbatch dimension, M / S microbatches each (`StageBatch`): under the
    hand-run backwards (1f1b, dualpipev) when S divides M; replicated over the stages otherwise."""
    return schedule in ("1f1b", "dualpipev") and num_stages > 1 and num_microbatches % num_stages == 0


class StageBatch:
    """A [M, ...] batch of microbatches inside shard_map over `pipeline`: split (stage q holds
    microbatches q * M / S .. (q + 1) * M / S - 1, the local array [M / S, ...]) or replicated
    ([M, ...] on every stage). Only one stage reads each microbatch (the stack's input on the first
    stage) or produces it (the output, the input gradient), one microbatch per tick: a split batch
    moves it between its owner and that stage with a psum over `pipeline` of the owner's slot (the other
    stages add zeros), so no stage holds the whole batch."""

    def __init__(self, split: bool, num_microbatches: int, num_stages: int):
        self.split = split
        self.per_stage = num_microbatches // num_stages if split else num_microbatches

    def spec(self) -> P:
        return P(AXIS) if self.split else P()

    def read(self, local_M_: jax.Array, i: jax.Array) -> jax.Array:
        """Microbatch i, on every stage."""
        if not self.split:
            return local_M_[i]
        return self._from(jax.lax.axis_index(AXIS) == i // self.per_stage, local_M_[i % self.per_stage])

    def write(self, local_M_: jax.Array, value: jax.Array, i: jax.Array, on: jax.Array, src: int) -> jax.Array:
        """Stores stage `src`'s `value` as microbatch i when `on` (the same on every stage)."""
        stage = jax.lax.axis_index(AXIS)
        if self.split:
            value = self._from(stage == src, value)
            keep, slot = on & (stage == i // self.per_stage), i % self.per_stage
        else:
            keep, slot = on & (stage == src), i
        return jax.lax.dynamic_update_index_in_dim(local_M_, jnp.where(keep, value, local_M_[slot]), slot, 0)

    def result(self, local_M_: jax.Array, src: int) -> jax.Array:
        """The written batch as the shard_map's output (`spec`): replicated, stage `src`'s, summed."""
        if self.split:
            return local_M_
        return self._from(jax.lax.axis_index(AXIS) == src, local_M_)

    def _from(self, on: jax.Array, value: jax.Array) -> jax.Array:
        """`value` of the one stage where `on` holds, on every stage (the others add zeros)."""
        return jax.lax.psum(jnp.where(on, value, jnp.zeros_like(value)), AXIS)


def split_stage_microbatches(x_Bx_: jax.Array, m: int, num_stages: int, batch_shards: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...] for a stack whose batch stays split over the stages
    (`splits_stack_batch`): with the rows in contiguous device blocks, `batch_shards` (the stage
    batch shards, rules.STAGE_BATCH_AXES) major and the S stages minor (rules.BATCH_AXES), stage q's
    microbatches q * M / S .. (q + 1) * M / S - 1 are made of rows every device (d, q) already holds:
    the [M / S, ...] slice each stage keeps inside the stack is where it was, split over the batch
    shards on its rows. Microbatch q * M / S + j takes block j of the M / S in each (d, q) block."""
    b = x_Bx_.shape[0]
    if m % num_stages or b % (m * batch_shards):
        raise ValueError(f"{b} rows do not split into {m} microbatches over {num_stages} stages x "
                         f"{batch_shards} batch shards")
    rows = b // (m * batch_shards)
    x = x_Bx_.reshape(batch_shards, num_stages, m // num_stages, rows, *x_Bx_.shape[1:])
    return jnp.moveaxis(x, 0, 2).reshape(m, batch_shards * rows, *x_Bx_.shape[1:])


def merge_stage_microbatches(x_MxB_: jax.Array, num_stages: int, batch_shards: int) -> jax.Array:
    """The inverse of `split_stage_microbatches`."""
    m, mb = x_MxB_.shape[:2]
    x = x_MxB_.reshape(num_stages, m // num_stages, batch_shards, mb // batch_shards, *x_MxB_.shape[2:])
    return jnp.moveaxis(x, 2, 0).reshape(m * mb, *x_MxB_.shape[2:])

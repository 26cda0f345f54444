"""Orbax checkpoints of the train state and the grain iterator: async, keep-N, every K steps.

A checkpoint is an `ocp.args.Composite` of `state` (the whole `TrainState`: parameters,
optimizer state, router biases, step, RNG, skip counters) and `data` (the grain iterator's
position), so a restore resumes at exactly the next batch. Saves are asynchronous (except on CPU,
see `Checkpointer`): the step loop continues while the previous checkpoint is written; a crash mid-write leaves only an unfinished
temporary folder, which Orbax ignores, so the last complete checkpoint is what a restart finds.

`preemption` turns SIGTERM (pre-emption) into a step, agreed by all processes, at which the run
saves a final checkpoint and exits cleanly instead of dying mid-step (or hanging in a collective).
"""

from __future__ import annotations

import contextlib
import logging
import signal

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from dsv3_jax import paths
from dsv3_jax.checkpoint import integrity, orbax_layout
from dsv3_jax.checkpoint.safetensors_io import CheckpointError
from sharding import multihost


class Checkpointer:
    def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True):
        """`async_save`: the caller's choice (the trainer saves synchronously on CPU, where device
        memory is host memory: an async save holds the saved step's buffers, zero-copy host views,
        while the next step runs, so that step cannot reuse them and the process holds two copies
        of its state)."""
        if every < 1 or keep < 1:
            raise ValueError(f"checkpoint every={every} and keep={keep} must be >= 1")
        self.every, self.keep = every, keep
        self._async = async_save
        self._verified: int | None = None  # the newest step read back intact
        # The interval (`every`, kept by the caller) and the rotation are not Orbax's: Orbax also saves whenever
        # no checkpoint exists yet, and its max_to_keep would delete intact steps behind a damaged one.
        options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=None,
                                               enable_async_checkpointing=async_save, create=True)
        # A local folder or a URL (gs://...): Orbax writes through epath and tensorstore either way.
        self.directory = paths.resolve(directory)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", integrity.ITEM))
        logging.getLogger("absl").addFilter(_drop_orbax_errors)

    def restore(self, abstract_state, data_iterator, step: int | None = None):
        """Restores the state (returned) and moves `data_iterator` to the saved position in place.
        Every array is checked against the step's checksums; without `step`, a damaged step is
        set aside (renamed `<step>.damaged`, nothing deleted) and the next older one is tried."""
        steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
        for s in steps:
            try:
                state = self._restore_checked(s, abstract_state, data_iterator)
            except CheckpointError as e:
                if step is not None or s == steps[-1]:
                    raise
                logging.warning("%s; setting it aside as %s.damaged and resuming from the step before", e, s)
                self._set_aside(s)
                continue
            self._verified = max(s, self._verified or s)
            return state
        raise CheckpointError(f"{self.directory} holds no checkpoint to restore")

    def _restore_checked(self, step: int, abstract_state, data_iterator):
        step_dir = paths.join(self.directory, str(step))
        manifest = integrity.read_manifest(step_dir)
        state_dir = paths.join(step_dir, "state")
        error = None
        integrity.quiet_abandoned_reads()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(data_iterator)))
        except Exception as e:  # Orbax passes TensorStore's read errors on as a bare Exception
            error = integrity.from_read_error(step, state_dir, e) or e
            _join_orbax_restore_barrier()
        # A process that read a damaged chunk of its own shards must not leave the others waiting in
        # the check's collective: all agree first, and all refuse the step (so all fall back) or none.
        if not _all_agree(error is None):
            raise error or CheckpointError(f"checkpoint step {step} is damaged: another process could not read "
                                           f"its part of {state_dir}")
        if manifest is None:
            logging.warning("checkpoint step %d has no checksums (saved before they were recorded): not verified",
                            step)
        else:
            integrity.check(step, state_dir, manifest, integrity.flat(restored["state"]))
        return restored["state"]

    def _set_aside(self, step: int) -> None:
        if jax.process_index() == 0:
            paths.at(paths.join(self.directory, str(step))).rename(paths.join(self.directory, f"{step}.damaged"))
        multihost.barrier(f"dsv3_set_aside_{step}")
        self.manager.reload()

    def save(self, step: int, state, data_iterator) -> bool:
        """Saves `step` (the caller keeps the interval, `every`); returns whether a save started."""
        self._finish_and_rotate()
        sums = integrity.checksums(state)
        try:
            started = self.manager.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator),
                **{integrity.ITEM: ocp.args.JsonSave({"checksums": sums})}))
        except Exception as e:  # what Orbax raises from its writers, e.g. OSError ENOSPC
            raise self._failed(step, e) from None
        if not self._async:
            self._finish_and_rotate()
        return started

    def _finish_and_rotate(self) -> None:
        """Waits for the pending save, then deletes the steps beyond the `keep` newest, but only
        those older than the newest step read back intact (the newest is read back when needed)."""
        self._wait()
        steps = sorted(self.manager.all_steps())
        if len(steps) <= self.keep:
            return
        if self._verified != steps[-1] and _all_agree(self._reads_back(steps[-1])):
            self._verified = steps[-1]
        for s in steps[:-self.keep]:
            if self._verified is not None and s < self._verified:
                self.manager.delete(s)

    def _reads_back(self, step: int) -> bool:
        """Whether this process's share of `step`'s arrays reads back with their checksums."""
        step_dir = paths.join(self.directory, str(step))
        manifest = integrity.read_manifest(step_dir)
        if manifest is None:
            return False
        try:
            orbax_layout.ItemReader(step_dir, "state").check(step, manifest)
        except CheckpointError as e:
            logging.warning("%s; keeping the older steps", e)
            return False
        return True

    def _wait(self) -> None:
        """Waits for the pending save; a failed one (a full disk) is one `CheckpointError` line."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # Orbax re-raises the writer thread's error
            raise self._failed(None, e) from None

    def _failed(self, step: int | None, e: Exception) -> CheckpointError:
        what = f"step {step}" if step is not None else "the last checkpoint"
        return CheckpointError(f"saving {what} in {self.directory} failed: {integrity.first_line(e)}")

    def close(self):
        """Waits for a pending async save, then releases the manager."""
        try:
            self._wait()
        finally:
            self.manager.close()


def _drop_orbax_errors(record: logging.LogRecord) -> bool:
    """Drops the errors Orbax's writer threads log, each with its traceback (a full disk: dozens of
    them): the failure reaches `Checkpointer._wait`, which raises it as one line."""
    return not (record.levelno >= logging.ERROR and "/orbax/checkpoint/" in record.pathname)


def _all_agree(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array([flag]))))


def _join_orbax_restore_barrier() -> None:
    """Joins the barrier Orbax's `Checkpointer.restore` ends with (`sync_global_processes(
    "Checkpointer:restore")`: the manager here sets no key prefix or active processes), which a
    process whose read raised skipped, so the others come out of it and reach `_all_agree`."""
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes("Checkpointer:restore")


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of a pytree of arrays or ShapeDtypeStructs, each in its sharding from
    `shardings`: a restore target that allocates nothing, each device reading only its own shards."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@contextlib.contextmanager
def preemption():
    """Turns SIGTERM (pre-emption) into a step at which every process saves and stops: yields
    `reached(step)`, called by every process after each step, True at the same step on all of them:
    - one process: the step after SIGTERM arrived (a Python handler notes it);
    - several (jax.distributed): JAX's preemption sync manager, started by `jax.distributed.initialize`,
      catches SIGTERM on whichever process gets it; the coordination service tells the others and
      they agree on the largest step any of them has reached, plus one
      (`sharding.multihost.reached_preemption`). So hosts signalled at different steps, or only one
      of them, all enter the collective save at the same step instead of hanging in the next step.
    """
    if jax.process_count() > 1:  # JAX's own SIGTERM handler feeds the sync manager
        yield multihost.reached_preemption
        return
    signalled = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: signalled.append(signum))
    try:
        yield lambda step: bool(signalled)
    finally:
        signal.signal(signal.SIGTERM, previous)

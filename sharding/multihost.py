"""Multi-process start-up and global arrays built from what each process holds.

One process per host (or per GPU), all running the same program: `initialize` joins them through
`jax.distributed` (coordinator address, process count and id from the arguments, else from
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else from the cluster's own
environment: TPU pods, SLURM, Open MPI are detected by jax). Each process then loads only the
batch rows its devices own (`process_rows`) and `global_batch` assembles the global array; a
pre-emption notice on any process becomes one step at which all of them stop (`reached_preemption`).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Sharding


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None) -> bool:
    """Joins the processes of a multi-process run; returns False (and does nothing) for one process.

    Call before anything touches a device.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if num_processes == 1 or (coordinator_address is None and num_processes is None and not _cluster_env()):
        return False
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)
    return True


def _cluster_env() -> bool:
    """A scheduler that jax.distributed detects by itself (SLURM, Open MPI, TPU pod metadata)."""
    return any(k in os.environ for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"))


def process_rows(sharding: Sharding, global_shape: tuple[int, ...]) -> slice:
    """The rows (leading dimension) of a global array that this process's devices hold."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(global_shape[0])
        starts.append(start)
        stops.append(stop)
    return slice(min(starts), max(stops))


def global_batch(local: dict, sharding: Sharding, global_rows: int) -> dict:
    """Global arrays [global_rows, ...] from this process's rows (`process_rows` of each array)."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), (global_rows,) + np.shape(v)[1:])
            for k, v in local.items()}


def reached_preemption(step: int) -> bool:
    """True, on every process at the same `step`, once any process got SIGTERM (a pre-emption notice).

    JAX's preemption sync manager (started by `jax.distributed.initialize`) catches the signal; the
    coordination service spreads the notice, and the processes agree on the largest step any of
    them has reached, plus one. Every process must call this after every step, with the same
    increasing step numbers. False without jax.distributed (one process)."""
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)


def barrier(name: str, timeout_s: float = 3600.0) -> None:
    """Waits until every process reaches the barrier `name` (unique per run), through the
    coordination service that `jax.distributed` started, not through a device collective: XLA:CPU
    creates a collective's gloo context at its first call and gives the other processes 30 s to
    join it, so `multihost_utils.sync_global_devices` (an all-gather) fails the same way as the
    step's first collective when processes arrive minutes apart. Nothing with one process."""
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost as ocp_multihost  # its public coordination-service barrier

    ocp_multihost.get_barrier_sync_fn()(key=name, timeout_ms=int(timeout_s * 1000))

"""Host tuning, in one place: what the CPU backend needs that accelerators do not. Each function
checks for the CPU itself and does nothing elsewhere; the entry points and the training loop call
them, model code never does (it takes the choices as config fields).

- `reexec()`: transparent huge pages for the host allocator, one page fault per 2 MB, not per 4 KB.
  XLA:CPU allocates a step's large buffers (gradients, optimizer outputs, activations) with malloc,
  which maps blocks over 32 MB fresh and unmaps them on free, so every step faults each 4 KB page
  in again (docs/benchmarks.md). Where the kernel's transparent huge pages are `madvise` (the
  usual default), glibc >= 2.35 asks for huge pages on its mappings when GLIBC_TUNABLES holds
  `glibc.malloc.hugetlb=1`. glibc reads that variable only at process start, so `reexec()`
  restarts the command with it set; call it before importing jax (the restart then costs an
  interpreter start). DSV3_HUGE_PAGES=0 turns it off. It changes no result, only where the host's
  memory comes from. Only where a restart is harmless and helps:
  - the CPU backend (`runs_on_cpu`), decided before jax starts a backend: if JAX_PLATFORMS is set,
    its first entry is `cpu`; if not, the host has no accelerator that jax would take (a TPU or GPU
    device node together with jax's plugin for it);
  - not under a tracer or debugger (`sys.gettrace()`, pdb, pydevd), which the restart would drop;
  - not in an interactive interpreter or kernel (IPython/ipykernel, `python -i`).
- `trim_heap()`: glibc's malloc_trim after a save, a restore or a compile, whose freed host memory
  otherwise stays in the process (the I/O threads' malloc arenas) with the next step's buffers on
  top; on CPU, where device memory is the heap.
- `tune_model(cfg)`: the training layer scan unrolled for short stacks on one CPU device (XLA:CPU
  otherwise copies each layer's residuals into and out of the loop's stacked buffers).
- `order_cpu_collectives()`: for a run of several processes on XLA:CPU, whose collectives (gloo) pair up
  by the order each process issues them: XLA:CPU's concurrency-optimised scheduler can issue a step's
  independent all-reduces in a different order on each process (seen with one device per process:
  gloo aborts on a size mismatch), so it is turned off there and the step's order is the program's.
- `init_compiler_options()`: XLA:CPU's cheapest code generation for the one-off initialisation
  (random draws and elementwise maths, which XLA:CPU optimises slowly).

jax is imported inside the functions: `reexec()` runs before jax is loaded.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import importlib.util
import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "DSV3_HUGE_PAGES"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
# Device nodes of an accelerator, each with the jax plugin modules that would use it.
_ACCELERATORS = (
    (("/dev/accel*", "/dev/vfio/[0-9]*"), ("libtpu",)),  # TPU (v2-v3 accel, v4+ vfio)
    (("/dev/nvidia[0-9]*",), ("jax_cuda12_plugin", "jax_cuda13_plugin")),
    (("/dev/kfd",), ("jax_rocm6_plugin", "jax_rocm7_plugin")),
)


def _glibc_has_hugetlb() -> bool:
    lib, version = platform.libc_ver()
    if lib != "glibc":
        return False
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (2, 35)


def _thp_available() -> bool:
    try:
        with open(_THP_MODE) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def with_tunable(env: dict) -> dict:
    """`env` with the huge-page tunable added to GLIBC_TUNABLES (other tunables kept)."""
    current = env.get("GLIBC_TUNABLES", "")
    if TUNABLE in current.split(":"):
        return dict(env)
    return dict(env, GLIBC_TUNABLES=f"{current}:{TUNABLE}" if current else TUNABLE)


def _accelerator() -> bool:
    """A device node of an accelerator with jax's plugin for it installed (found, not imported)."""
    return any(any(glob.glob(pattern) for pattern in nodes) and any(importlib.util.find_spec(m) for m in plugins)
               for nodes, plugins in _ACCELERATORS)


def runs_on_cpu(env=None) -> bool:
    """True when jax will run on its CPU backend (the module docstring's rule), without starting one."""
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", env.get("JAX_PLATFORM_NAME", "")).strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not _accelerator()


def wanted(env=None) -> bool:
    """True where the restart would change something and help: Linux glibc >= 2.35, THP not
    `never`, the CPU backend, not opted out, tunable not yet set. `env` may be a child's."""
    env = os.environ if env is None else env
    return (sys.platform == "linux" and env.get(OPT_OUT, "1") != "0" and _glibc_has_hugetlb()
            and _thp_available() and TUNABLE not in env.get("GLIBC_TUNABLES", "").split(":")
            and runs_on_cpu(env))


def restart_blocker() -> str | None:
    """Why this process must not be restarted (the module docstring), or None."""
    if sys.gettrace() is not None or any(m in sys.modules for m in ("bdb", "pydevd")):
        # bdb: pdb with no breakpoints drops its trace function on `continue`, yet stays the parent
        return "a tracer or debugger is active (sys.gettrace, pdb, pydevd)"
    if "IPython" in sys.modules or "ipykernel" in sys.modules:
        return "an interactive kernel (IPython) runs this process"
    if sys.flags.interactive or hasattr(sys, "ps1"):
        return "an interactive interpreter runs this process"
    return None


def reexec() -> None:
    """Restarts this command (same pid, argv, environment) with the tunable set, where `wanted`
    and nothing blocks a restart."""
    if wanted() and restart_blocker() is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], with_tunable(os.environ))


def on_cpu() -> bool:
    """True when jax's default backend is its CPU."""
    import jax

    return jax.default_backend() == "cpu"


def trim_heap() -> None:
    """On CPU, hands the heap memory that a save, a restore or a compile freed back to the OS."""
    if not on_cpu():
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


UNROLL_MAX_LAYERS = 8


def tune_model(cfg):
    """`cfg` (a ModelConfig) with the training scan unrolled for stacks of at most
    UNROLL_MAX_LAYERS layers on one CPU device, unless it sets `unroll_max_layers` itself;
    unchanged elsewhere, where compile time flat in depth is what counts, and on several devices
    (docs/benchmarks.md)."""
    import jax

    if not cfg.unroll_max_layers and on_cpu() and jax.device_count() == 1:
        return dataclasses.replace(cfg, unroll_max_layers=UNROLL_MAX_LAYERS)
    return cfg


SERIAL_COLLECTIVES_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def order_cpu_collectives() -> None:
    """On the CPU backend, XLA_FLAGS gains SERIAL_COLLECTIVES_FLAG (the module docstring). Call it in
    a process of a multi-process run, before jax starts its backend; a no-op elsewhere."""
    flags = os.environ.get("XLA_FLAGS", "")
    if runs_on_cpu() and "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SERIAL_COLLECTIVES_FLAG}".strip()


def init_compiler_options() -> dict | None:
    """`compiler_options` for jitting a run's initialisation: XLA:CPU's cheapest code generation, None
    elsewhere."""
    if on_cpu():
        return {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    return None

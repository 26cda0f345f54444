"""Transparent huge pages for the host allocator: one page fault per 2 MB, not per 4 KB.

XLA:CPU allocates a step's large buffers (gradients, optimizer outputs, activations) with malloc,
which maps blocks over 32 MB fresh and unmaps them on free, so every step faults each 4 KB page
in again: ~200k faults a step for the issue-11 config at 128 experts (~0.8 GB), measured with
`/usr/bin/time -f %R` (docs/benchmarks.md). Where the kernel's transparent huge pages are
`madvise` (the usual default), glibc >= 2.35 asks for huge pages on its mappings when
GLIBC_TUNABLES holds `glibc.malloc.hugetlb=1`. glibc reads that variable only at process start,
so `reexec()` restarts the command with it set; call it before importing jax (the restart then
costs an interpreter start). DSV3_HUGE_PAGES=0 turns it off. It changes no result, only where
the host's memory comes from.

Only where it was measured to help, and only where a restart is harmless:
- the CPU backend (`runs_on_cpu`), decided before jax starts a backend (that is what the restart
  must precede): if JAX_PLATFORMS is set, its first entry, the platform jax tries first, is
  `cpu`; if not, the host has no accelerator that jax would take, i.e. no TPU or GPU device node
  (/dev/accel*, /dev/vfio/<n>, /dev/nvidia<n>, /dev/kfd) together with jax's plugin for it
  (libtpu, jax_cuda*/jax_rocm* plugins). On TPU/GPU hosts the step's buffers live on the
  device, and the host's allocator is not where the time goes;
- not under a tracer or debugger (`sys.gettrace()`: pdb, debuggers, coverage; or pdb/pydevd
  loaded), which the restart would drop (a second prompt, breakpoints lost);
- not in an interactive interpreter or kernel (IPython/ipykernel loaded, `python -i`), which the
  restart would replace.
"""

from __future__ import annotations

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


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None  # finds, does not import
    except (ImportError, ValueError):
        return False


def _accelerator() -> bool:
    return any(any(glob.glob(pattern) for pattern in nodes) and any(_has_module(m) for m in plugins)
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

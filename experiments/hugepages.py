"""Transparent huge pages for the host allocator: one page fault per 2 MB, not per 4 KB.

XLA:CPU allocates a step's large buffers (gradients, optimizer outputs, activations) with malloc,
which maps blocks over 32 MB fresh and unmaps them on free, so every step faults each 4 KB page
in again: ~200k faults a step for the issue-11 config at 128 experts (~0.8 GB), measured with
`/usr/bin/time -f %R` (docs/benchmarks.md). Where the kernel's transparent huge pages are
`madvise` (the usual default), glibc >= 2.35 asks for huge pages on its mappings when
GLIBC_TUNABLES holds `glibc.malloc.hugetlb=1`. glibc reads that variable only at process start,
so `reexec()` restarts the command with it set; call it before importing jax (the restart then
costs an interpreter start). DSV3_HUGE_PAGES=0 turns it off. It changes no result, only where
the host's memory comes from; on TPU/GPU hosts it touches only host-side buffers.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "DSV3_HUGE_PAGES"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def wanted(env=None) -> bool:
    """True where the restart would change something: Linux glibc >= 2.35, THP not `never`, not
    opted out, tunable not yet set."""
    env = os.environ if env is None else env
    return (sys.platform == "linux" and env.get(OPT_OUT, "1") != "0" and _glibc_has_hugetlb()
            and _thp_available() and TUNABLE not in env.get("GLIBC_TUNABLES", "").split(":"))


def reexec() -> None:
    """Restarts this command (same pid, argv, environment) with the tunable set, where `wanted`."""
    if wanted():
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], with_tunable(os.environ))

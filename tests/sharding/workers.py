"""Runs fake-device programs (`tests.sharding.*_worker`) in fresh processes and reads their JSON lines.

The runner, its stall rule and the environments are `tests.helpers`; the names below stay for the
callers that import them from here.
"""

import json
import sys

from tests.helpers import REPO, fake_device_env, fake_device_flags, run  # noqa: F401

FAKE_DEVICES_XLA_FLAGS = fake_device_flags(8)


def run_worker(module: str, *args: str, timeout: int = 600) -> list[dict]:
    """The JSON objects the worker prints, one per line; fails with its stderr if it exits non-zero."""
    out = run([sys.executable, "-m", module, *args], fake_device_env(), timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

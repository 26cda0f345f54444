"""Runs fake-device programs (`tests.sharding.*_worker`, `experiments.train`) in fresh processes.

XLA:CPU with 8 fake devices on this 2-core machine has, rarely, stalled inside the runtime
(jax 0.10.2: every thread idle, the main thread waiting in PjRtLoadedExecutable::Execute, no
collective timeout firing). A slow run still burns CPU; a stalled one burns none. So a child whose
CPU time has not moved for `STALL_S` seconds is killed and started once more; the test fails if
that run fails or stalls too, and also on the overall `timeout`.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STALL_S = 180.0


class Stalled(RuntimeError):
    pass


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` and its threads (Linux /proc), 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _run_once(cmd, env, timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        start = last_change = time.monotonic()
        last_cpu = -1.0
        while proc.poll() is None:
            time.sleep(2.0)
            now, cpu = time.monotonic(), _cpu_seconds(proc.pid)
            if cpu != last_cpu:
                last_cpu, last_change = cpu, now
            if now - start > timeout or now - last_change > STALL_S:
                proc.kill()
                proc.wait()
                err.seek(0)
                why = "timed out" if now - start > timeout else f"stalled (no CPU time for {STALL_S:.0f} s)"
                raise Stalled(f"{' '.join(map(str, cmd[:4]))} ... {why}; stderr tail:\n{err.read()[-2000:]}")
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def run(cmd, env, timeout: float = 900) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True) with the stall rule."""
    try:
        return _run_once(cmd, env, timeout)
    except Stalled as first:
        if "timed out" in str(first):
            raise
        print(f"rerunning after a stall: {first}", file=sys.stderr)
        return _run_once(cmd, env, timeout)


FAKE_DEVICES_XLA_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=900 "
                          "--xla_cpu_collective_timeout_seconds=900 --xla_force_host_platform_device_count=8")


def fake_device_env(**extra) -> dict:
    """Environment for a child process with fake CPU devices (the worker sets XLA_FLAGS unless
    `extra` does). No persistent compilation cache: a multi-device executable loaded from the
    session's cache stalled in its first collective (all devices waiting in rendezvous; jax 0.10.2,
    reproduced twice), while the same program compiled afresh runs."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_ENABLE_COMPILATION_CACHE="false")
    env.pop("XLA_FLAGS", None)  # the worker chooses its device count
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.update(extra)
    return env


def run_worker(module: str, *args: str, timeout: int = 600) -> list[dict]:
    """The JSON objects the worker prints, one per line; fails with its stderr if it exits non-zero."""
    out = run([sys.executable, "-m", module, *args], fake_device_env(), timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

"""What many test files need, written once: the repository root, environments for child processes
(fake CPU devices), one subprocess runner, relative errors, and the shrunk tiny model.

Importing this module imports neither jax nor the model, so fake-device workers can use it before
they set XLA_FLAGS.

The runner: XLA:CPU with 8 fake devices on a 2-core machine has, rarely, stalled inside the
runtime (jax 0.10.2: every thread idle, the main thread waiting in PjRtLoadedExecutable::Execute,
no collective timeout firing). A slow run still burns CPU; a stalled one burns none. So a child
whose CPU time has not moved for `STALL_S` seconds is killed and started once more; the test fails
if that run fails or stalls too, and also on the overall `timeout`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Collectives on an oversubscribed 2-core machine can wait minutes for a peer; the default timeout
# would abort them.
_COLLECTIVE_TIMEOUTS = ("--xla_cpu_collective_call_terminate_timeout_seconds=900 "
                        "--xla_cpu_collective_timeout_seconds=900")
# Fake-device programs are compiled afresh (see `fake_device_env`); cheaper codegen halves that, and
# XLA:CPU's classic fusion emitters cut another third of the compile (the MLIR ones build and
# canonicalize an MLIR module per fusion) where XLA still has them: newer XLA (jax 0.12) has only the
# MLIR ones and aborts on the unknown flag, so it is kept only if a child process accepts it. Every
# comparison runs both sides with these flags.
_CHEAP_CODEGEN = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_CLASSIC_FUSION = "--xla_cpu_use_fusion_emitters=false"
_FAST_COMPILE_ENV = "DSV3_TESTS_FAST_COMPILE"  # the probe's answer, inherited by workers and children


def _fast_compile_flags() -> str:
    if _FAST_COMPILE_ENV not in os.environ:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1).block_until_ready()"],
                               env={**os.environ, "XLA_FLAGS": _CLASSIC_FUSION, "JAX_PLATFORMS": "cpu"},
                               capture_output=True, timeout=120)
        classic = _CLASSIC_FUSION if probe.returncode == 0 else ""
        os.environ[_FAST_COMPILE_ENV] = f"{_CHEAP_CODEGEN} {classic}".strip()
    return os.environ[_FAST_COMPILE_ENV]


FAST_COMPILE = _fast_compile_flags()
STALL_S = 180.0


def fake_device_flags(devices: int = 8, *, fast_compile: bool = True) -> str:
    """XLA_FLAGS for `devices` fake CPU devices (compiled with `FAST_COMPILE` unless told not to);
    must be set before jax is imported."""
    flags = f"{_COLLECTIVE_TIMEOUTS} --xla_force_host_platform_device_count={devices}"
    return f"{flags} {FAST_COMPILE}" if fast_compile else flags


def repo_env(**extra: str) -> dict:
    """Environment for a child process that imports this checkout's packages, on CPU."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def fake_device_env(devices: int | None = None, **extra: str) -> dict:
    """Environment for a child process with fake CPU devices.

    With `devices`, XLA_FLAGS asks for that many, compiled with `FAST_COMPILE`; without, XLA_FLAGS
    is unset and the worker chooses its device count itself (`extra` may still set it). No
    persistent compilation cache: a multi-device executable loaded from the session's cache stalled
    in its first collective (all devices waiting in rendezvous; jax 0.10.2, reproduced twice), while
    the same program compiled afresh runs.
    """
    env = repo_env(JAX_ENABLE_COMPILATION_CACHE="false")
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if devices is not None:
        env["XLA_FLAGS"] = fake_device_flags(devices)
    env.update(extra)
    return env


def session_root(tmp_path_factory):
    """The folder every pytest-xdist worker of this session shares (the session's own base folder
    when pytest runs without workers)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory, name: str, build):
    """`build(folder)` once per test session, by whichever worker asks first; the others wait on a
    file lock and get the finished folder (theirs to read, not to write). A build that raised leaves
    no `.done` mark, so the next asker builds afresh."""
    import filelock

    root = session_root(tmp_path_factory)
    folder, done = root / name, root / f"{name}.done"
    with filelock.FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


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


def run(cmd, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, cwd=REPO, env=env or repo_env(), capture_output=True, text=True), with
    the stall rule above."""
    env = repo_env() if env is None else env
    try:
        return _run_once(cmd, env, timeout)
    except Stalled as first:
        if "timed out" in str(first):
            raise
        print(f"rerunning after a stall: {first}", file=sys.stderr)
        return _run_once(cmd, env, timeout)


def run_module(module: str, *args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repository root (see `run`)."""
    return run([sys.executable, "-m", module, *map(str, args)], env, timeout)


def rel_err(got, want) -> float:
    """max |got - want| / max |want|, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def tree_rel_err(got, want) -> float:
    """The largest ||got - want|| / ||want|| (Frobenius) over the leaves of two pytrees."""
    import jax

    diffs = [np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64))
             / max(np.linalg.norm(np.asarray(y, np.float64)), 1e-30)
             for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    return float(max(diffs))


# The tiny preset shrunk further, every feature still on (q LoRA, groups, a dense and an MoE layer,
# shared expert, MTP), so a model compiles and trains a few steps in seconds.
SHRUNK = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_layers=2, num_heads=2,
              q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def shrunk_tiny_config(**overrides):
    """`ModelConfig.tiny()` with the `SHRUNK` sizes; `overrides` win."""
    from dsv3_jax.config import ModelConfig

    return ModelConfig.tiny(**{**SHRUNK, **overrides})


def shrunk_flags(prefix: str = "--config.model.", **overrides) -> list[str]:
    """The `SHRUNK` sizes (`overrides` win) as command-line overrides of an ml_collections config."""
    return [f"{prefix}{name}={value}" for name, value in {**SHRUNK, **overrides}.items()]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (servers and jax.distributed coordinators in tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_cluster(env: dict) -> dict:
    """`env` without the JAX_* variables that would make a child join another cluster."""
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(key, None)
    return env


@contextlib.contextmanager
def app_in_thread(app):
    """An ASGI `app` served by uvicorn on 127.0.0.1 (a free port) in a thread; yields its base url."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def http_json(url: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of a GET, or of a POST of `body` as JSON; an HTTP error's status and body too."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class TokenSink:
    """An engine request's sink: the streamed token ids, the finish reason, and an event set at the end."""

    def __init__(self):
        self.tokens, self.done = [], threading.Event()
        self.reason = None

    def __call__(self, event):
        self.tokens.extend(event.token_ids)
        if event.finish_reason is not None:
            self.reason = event.finish_reason
            self.done.set()

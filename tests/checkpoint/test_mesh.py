"""Acceptance 5: with an 8-device mesh (fake CPU devices, in a subprocess) every parameter is
restored straight into its sharding."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.checkpoint.conftest import convert

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_restore_onto_8_device_mesh(hf_folders, tmp_path):
    assert convert("--hf-dir", hf_folders["fp8"], "--out", tmp_path / "ckpt") == 0
    assert convert("--hf-dir", hf_folders["fp8"], "--out", tmp_path / "kept", "--keep-fp8") == 0
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=900 --xla_cpu_collective_timeout_seconds=900 --xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "tests.checkpoint._mesh_restore", hf_folders["fp8"],
                          str(tmp_path / "ckpt"), str(tmp_path / "kept")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "MESH OK" in run.stdout, run.stderr[-4000:]

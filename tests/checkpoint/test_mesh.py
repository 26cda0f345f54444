"""Acceptance 5: with an 8-device mesh (fake CPU devices, in a subprocess) every parameter is
restored straight into its sharding."""

from __future__ import annotations

import os
import sys

from tests.checkpoint.conftest import convert
from tests.sharding import workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_restore_onto_8_device_mesh(hf_folders, tmp_path):
    assert convert("--hf-dir", hf_folders["fp8"], "--out", tmp_path / "ckpt") == 0
    assert convert("--hf-dir", hf_folders["fp8"], "--out", tmp_path / "kept", "--keep-fp8") == 0
    env = workers.fake_device_env(XLA_FLAGS=workers.FAKE_DEVICES_XLA_FLAGS)
    run = workers.run([sys.executable, "-m", "tests.checkpoint._mesh_restore", hf_folders["fp8"],
                       str(tmp_path / "ckpt"), str(tmp_path / "kept")], env, timeout=600)
    assert run.returncode == 0 and "MESH OK" in run.stdout, run.stderr[-4000:]

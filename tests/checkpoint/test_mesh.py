"""Acceptance 5: with an 8-device mesh (fake CPU devices, in a subprocess) every parameter is
restored straight into its sharding."""

from __future__ import annotations

from tests import helpers
from tests.checkpoint.conftest import convert


def test_restore_onto_8_device_mesh(hf_folders, tmp_path):
    assert convert("--hf-dir", hf_folders["fp8"], "--out", tmp_path / "ckpt") == 0
    assert convert("--hf-dir", hf_folders["fp8"], "--out", tmp_path / "kept", "--keep-fp8") == 0
    run = helpers.run_module("tests.checkpoint._mesh_restore", hf_folders["fp8"], tmp_path / "ckpt",
                             tmp_path / "kept", env=helpers.fake_device_env(8), timeout=600)
    assert run.returncode == 0 and "MESH OK" in run.stdout, run.stderr[-4000:]

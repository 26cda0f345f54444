"""Safetensors headers checked as the format specifies, the `safetensors` library as the reference:
every file it writes reads back equal, every damaged file it refuses we refuse too, naming the
file and the tensor; the CLIs say so in one line and exit 2; `--overwrite` loses nothing to a kill."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

from dsv3_jax.checkpoint import hf_to_orbax, load_pretrained, safetensors_io
from dsv3_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, write_safetensors
from tests.checkpoint.conftest import convert
from tests.helpers import run_module

PARITY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "parity", "lora_groups_yarn")


def test_reads_every_file_the_library_writes(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"t.{dt.__name__}": (rng.normal(size=(3, 5)) * 50).astype(dt) for dt in
              (np.float64, np.float32, np.float16, np.int64, np.uint64, np.int32, np.uint32, np.int16, np.uint16,
               np.int8, np.uint8, np.bool_, np.complex64)}
    arrays.update({"empty": np.zeros((0, 4), np.float32), "scalar": np.array(7, np.int32)})
    safetensors.numpy.save_file(arrays, tmp_path / "np.safetensors", metadata={"format": "np", "note": "ü"})
    weights = {"bf16": torch.randn(4, 6, dtype=torch.bfloat16), "e4m3": torch.randn(2, 8).to(torch.float8_e4m3fn),
               "e5m2": torch.randn(8).to(torch.float8_e5m2), "e8m0": torch.rand(5).to(torch.float8_e8m0fnu),
               "e4m3fnuz": torch.randn(3).to(torch.float8_e4m3fnuz), "e5m2fnuz": torch.randn(3).to(torch.float8_e5m2fnuz),
               "none": torch.zeros(2, 0, dtype=torch.bfloat16)}
    safetensors.torch.save_file(weights, tmp_path / "pt.safetensors", metadata={"format": "pt"})

    for path, framework in [(tmp_path / "np.safetensors", "np"), (tmp_path / "pt.safetensors", "pt")]:
        ours = SafetensorsFile(path)
        with safetensors.safe_open(path, framework) as ref:
            assert ours.metadata == ref.metadata() and sorted(ours.keys()) == sorted(ref.keys())
            for name in ref.keys():
                want, got = ref.get_tensor(name), ours.read(name)
                want_bytes = want.view(torch.uint8).numpy().tobytes() if framework == "pt" else want.tobytes()
                assert (got.shape, got.tobytes()) == (tuple(want.shape), want_bytes), name
                assert str(got.dtype) == str(want.dtype).removeprefix("torch."), name
    # and the library reads what we write, including bf16 (through torch)
    write_safetensors(tmp_path / "ours.safetensors", {"w": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
                                                       "e": np.zeros(0, np.int8)}, metadata={"format": "pt"})
    back = safetensors.torch.load_file(tmp_path / "ours.safetensors")
    assert back["w"].dtype == torch.bfloat16 and back["w"].float().numpy().ravel().tolist() == list(range(6))


def _valid(path):
    """a, b: same-shaped F32 neighbours; c: 3 I16 (6 bytes). Returns (header dict, data bytes)."""
    safetensors.numpy.save_file({"a": np.arange(4, dtype=np.float32), "b": -np.arange(4, dtype=np.float32),
                                 "c": np.arange(3, dtype=np.int16)}, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header: bytes | dict, data: bytes, length: int | None = None):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


def _move(header, name, begin, end):
    header[name]["data_offsets"] = [begin, end]
    return header


# case: (damage(header, data, path), words our error must hold besides the file)
CASES = {
    "overlap": (lambda h, d, p: _write(p, _move(h, "b", *h["a"]["data_offsets"]), d), ["tensor b", "overlaps tensor a"]),
    "gap": (lambda h, d, p: _write(p, _move(_move(h, "b", 24, 40), "c", 40, 46), d[:16] + bytes(8) + d[16:]),
            ["tensor b", "8 unused bytes after tensor a"]),
    "huge_header_length": (lambda h, d, p: _write(p, h, d, length=2**64 - 1), ["header length field", str(2**64 - 1)]),
    "header_length_past_the_end": (lambda h, d, p: _write(p, h, d, length=len(json.dumps(h)) + len(d) + 1),
                                   ["header length field"]),
    "truncated": (lambda h, d, p: _write(p, h, d[:-4]), ["tensor c", "truncated"]),
    "bytes_after_the_last_tensor": (lambda h, d, p: _write(p, h, d + bytes(4)), ["4 bytes after tensor c"]),
    "bad_utf8_header": (lambda h, d, p: _write(p, json.dumps(h).encode().replace(b'"a"', b'"\xff"'), d),
                        ["header is not UTF-8 JSON"]),
    "not_json_header": (lambda h, d, p: _write(p, b'{"a": {"dtype": "F32",' + b" " * 40, d), ["header is not UTF-8 JSON"]),
    "shape_and_offsets_disagree": (lambda h, d, p: _write(p, {**h, "a": {**h["a"], "shape": [5]}}, d),
                                   ["tensor a", "20 bytes", "span 16"]),
    "unknown_dtype": (lambda h, d, p: _write(p, {**h, "c": {**h["c"], "dtype": "I12"}}, d), ["tensor c", "'I12'"]),
    "negative_offset": (lambda h, d, p: _write(p, _move(h, "a", -16, 0), d), ["tensor a", "malformed"]),
    "metadata_not_strings": (lambda h, d, p: _write(p, {**h, "__metadata__": {"step": 3}}, d), ["__metadata__"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_header_is_refused_by_the_library_and_by_name(tmp_path, case):
    damage, words = CASES[case]
    path = tmp_path / "model.safetensors"
    header, data = _valid(path)
    damage(header, data, path)
    with pytest.raises(safetensors.SafetensorError):
        safetensors.numpy.load_file(path)
    with pytest.raises(CheckpointError) as err:
        SafetensorsFile(path)
    for w in [str(path), *words]:
        assert w in str(err.value), (w, str(err.value))


def test_a_huge_header_length_reads_nothing(tmp_path, monkeypatch):
    """The length field is refused from the file's size alone: the header is never read."""
    path = tmp_path / "x.safetensors"
    header, data = _valid(path)
    _write(path, header, data, length=2**40)
    reads = []
    real_open = open
    monkeypatch.setattr(safetensors_io, "open", lambda *a: _counting(real_open(*a), reads), raising=False)
    with pytest.raises(CheckpointError, match="header length field"):
        SafetensorsFile(path)
    assert reads == [8]


class _counting:
    def __init__(self, f, reads):
        self.f, self.reads = f, reads

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def read(self, n):
        self.reads.append(n)
        return self.f.read(n)


def _overlapping_copy(tmp_path) -> tuple[str, str]:
    """The parity fixture with one tensor's offsets pointing at its same-shaped neighbour's bytes
    (the damage that once loaded silently). Returns (folder, the tensor's name)."""
    folder = tmp_path / "hf"
    shutil.copytree(PARITY, folder)
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    shapes: dict = {}
    for name, e in header.items():
        if name != "__metadata__":
            shapes.setdefault((e["dtype"], tuple(e["shape"])), []).append(name)
    a, b = next(v for v in shapes.values() if len(v) > 1)[:2]
    header[b]["data_offsets"] = header[a]["data_offsets"]
    _write(path, header, raw[8 + n:])
    return str(folder), b


def test_load_pretrained_refuses_overlapping_offsets(tmp_path):
    folder, name = _overlapping_copy(tmp_path)
    with pytest.raises(CheckpointError, match=rf"tensor {name} in .*model\.safetensors .*overlaps"):
        load_pretrained(folder)


def test_convert_names_the_damaged_tensor_in_one_line(tmp_path, capsys):
    folder, name = _overlapping_copy(tmp_path)
    assert convert("--hf-dir", folder, "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and f"tensor {name}" in err, err
    assert not any(p.startswith("out") for p in os.listdir(tmp_path))


def test_generate_names_the_damaged_tensor_in_one_line(tmp_path):
    folder, name = _overlapping_copy(tmp_path)
    res = run_module("experiments.generate", f"--checkpoint={folder}", "--prompt=x", timeout=600)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and res.stderr.strip().splitlines()[-1].startswith("error: "), res.stderr
    assert f"tensor {name}" in res.stderr


def test_train_init_from_names_the_damaged_tensor_in_one_line(tmp_path):
    folder, name = _overlapping_copy(tmp_path)
    res = run_module("experiments.train", f"--init_from={folder}", f"--workdir={tmp_path / 'run'}", "--steps=1",
                     timeout=600)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and res.stderr.strip().splitlines()[-1].startswith("error: "), res.stderr
    assert f"tensor {name}" in res.stderr


def test_serve_names_the_damaged_tensor_in_one_line(tmp_path, capsys):
    pytest.importorskip("fastapi")
    from experiments.serve import main

    folder, name = _overlapping_copy(tmp_path)
    assert main([f"--checkpoint={folder}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and f"tensor {name}" in err, err


def test_full_disk_during_export_is_one_line_naming_the_output(hf_folders, tmp_path, capsys, monkeypatch):
    """ENOSPC as the OS gives it (no file name): the line names --out; nothing is left behind."""
    assert convert("--hf-dir", hf_folders["bf16"], "--out", tmp_path / "ckpt") == 0

    def full(self, name, arr):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors_io.ShardWriter, "write", full)
    capsys.readouterr()
    assert convert("--to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'hf'}: No space left on device\n", err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_kill_between_the_overwrite_renames_keeps_the_old_output(hf_folders, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert convert("--hf-dir", hf_folders["fp32"], "--out", out) == 0
    old = sorted(os.listdir(out))
    rename = os.rename

    def killed_before_the_new_output_is_in_place(src, dst):
        if os.fspath(dst) == str(out):
            raise KeyboardInterrupt  # the process dies here: nothing after runs
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_before_the_new_output_is_in_place)
    with pytest.raises(KeyboardInterrupt):
        convert("--hf-dir", hf_folders["bf16"], "--out", out, "--overwrite")
    monkeypatch.setattr(os, "rename", rename)
    assert not out.exists() and sorted(os.listdir(f"{out}{hf_to_orbax.REPLACED}")) == old
    # The next run puts the old output back before it refuses to overwrite it ...
    assert convert("--hf-dir", hf_folders["bf16"], "--out", out) == 2
    assert sorted(os.listdir(out)) == old and load_pretrained(out).config.param_dtype == "float32"
    # ... or replaces it when asked, leaving nothing else.
    assert convert("--hf-dir", hf_folders["bf16"], "--out", out, "--overwrite") == 0
    assert load_pretrained(out).config.param_dtype == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_tensorstore_error_is_one_line_naming_the_file(tmp_path, capsys):
    """TensorStore's errors end in its whole spec as JSON: the line keeps the message and the file."""
    import tensorstore as ts

    from dsv3_jax import cli

    with pytest.raises(ValueError) as err:
        ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": f"{tmp_path}/missing/"}}, open=True).result()
    assert "tensorstore_spec" in str(err.value)
    assert cli.fail(err.value) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "tensorstore_spec" not in line and f"{tmp_path}/missing/.zarray" in line, line

"""Checkpoint integrity: checksums saved with each step, damaged steps refused by name, resumes that
fall back to the newest intact step, rotation that never deletes the last intact step.

The damaged runs are copies of the session's one trained run (tests/conftest.py `trained_run`):
bytes flipped inside, or the file cut through, the chunk of one array, found in the step's OCDBT
b-tree (tensorstore's own dump of it).
"""

from __future__ import annotations

import os
import re
import shutil
import sys

import grain
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from flax import nnx

from dsv3_jax.checkpoint import CheckpointError, integrity, load_pretrained, orbax_layout
from dsv3_jax.convert import main as convert_main
from dsv3_jax.train import checkpointing
from dsv3_jax.train.checkpointing import Checkpointer
from tests.checkpoint.conftest import convert
from tests.helpers import repo_env, run
from tests.train.conftest import RESUME_FLAGS, STEPS, read_records, run_train, shared_compile_cache

ARRAY = "params.embed"  # the array damaged in the run copies


def chunks(item_dir) -> dict[str, tuple[str, int, int]]:
    """{array: (data file, offset, length) of its first stored chunk} of an OCDBT item."""
    kv = ts.KvStore.open({"driver": "file", "path": str(item_dir) + "/"}).result()
    pending = [v["root"]["location"] for v in ts.ocdbt.dump(kv).result()["versions"][-1:]]
    out = {}
    while pending:
        for entry in ts.ocdbt.dump(kv, pending.pop()).result()["entries"]:
            pending += [v for v in entry.values() if isinstance(v, str) and v.startswith("btreenode:")]
            name = entry.get("key", b"").decode().split("/")[0]
            if "indirect_value" in entry and name not in out:
                prefix, file, offset, length = re.match(r"value:([^:]*):([^:]+):(\d+):(\d+)$",
                                                        entry["indirect_value"]).groups()
                out[name] = f"{item_dir}/{prefix}{file}", int(offset), int(length)
    return out


def damage(step_dir, how: str) -> str:
    """Flips bytes inside, or cuts the file through, the chunk of ARRAY; returns the file."""
    file, offset, length = chunks(step_dir / "state")[ARRAY]
    data = bytearray(open(file, "rb").read())
    if how == "flip":
        middle = slice(offset + length // 2, offset + length // 2 + 16)
        data[middle] = bytes(b ^ 0xFF for b in data[middle])
    else:
        data = data[:offset + length // 2]
    open(file, "wb").write(bytes(data))
    return file


@pytest.fixture
def run_copy(trained_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(trained_run, dst)
    return dst


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return shared_compile_cache(tmp_path_factory)


def steps_of(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- the checksum ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8, np.bool_])
def test_checksum_adds_up_over_any_cut_and_sees_every_bit(dtype):
    x = np.random.default_rng(0).standard_normal((6, 5, 4)) > 0 if dtype is np.bool_ else (
        np.random.default_rng(0).standard_normal((6, 5, 4)) * 50).astype(dtype)
    whole = integrity.checksums({"x": jnp.asarray(x)})["x"]
    assert integrity.checksum_block(x, x.shape) == whole  # the host formula is the device one
    parts = [integrity.checksum_block(x[i:i + 2], x.shape, (i,)) for i in range(0, 6, 2)]  # blocks of 2 rows
    assert sum(parts) % 2**32 == whole
    tiles = [integrity.checksum_block(x[i:i + 3, :, j:j + 2], x.shape, (i, 0, j)) for i in (0, 3) for j in (0, 2)]
    assert sum(tiles) % 2**32 == whole  # blocks that are not runs of the flat order
    flat = x.reshape(-1).view(np.uint8).copy()
    for byte in (0, flat.size // 2, flat.size - 1):  # one bit anywhere changes it
        flipped = flat.copy()
        flipped[byte] ^= 1
        assert integrity.checksum_block(flipped.view(x.dtype).reshape(x.shape), x.shape) != whole
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values elsewhere: the position counts
    assert (swapped == x).all() or integrity.checksum_block(swapped, x.shape) != whole


def test_checksum_of_a_sharded_array_equals_the_unsharded_one():
    x = jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6)
    mesh = jax.make_mesh((1,), ("d",))
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    assert integrity.checksums({"a": sharded}) == integrity.checksums({"a": np.asarray(x)})
    key = jax.random.key(3)
    assert integrity.checksums({"k": key})["k"] == integrity.checksum_block(np.asarray(jax.random.key_data(key)), (2,))


# --- a converted checkpoint (python -m dsv3_jax.convert) ---------------------------------------

def _flip(file) -> None:
    data = bytearray(open(file, "rb").read())
    data[len(data) // 2:len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 16])
    open(file, "wb").write(bytes(data))


def test_a_converted_checkpoint_is_checked_by_load_pretrained(hf_folders, tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    assert convert("--hf-dir", hf_folders["fp8"], "--out", ckpt, "--keep-fp8") == 0  # both items: params, fp8
    sums = integrity.read_manifest(ckpt)
    for item in (orbax_layout.PARAMS, orbax_layout.FP8):  # summed piece by piece = the whole array's checksum
        reader = orbax_layout.ItemReader(str(ckpt), item)
        whole = {name: reader.read(tuple(name.split("."))) for name in sums[item]}
        assert sums[item] == integrity.checksums(whole) and len(whole) > 3
    loaded = nnx.state(load_pretrained(ckpt, dtype="float32"))

    for item, name in [(orbax_layout.PARAMS, "embed"), (orbax_layout.FP8, next(iter(sums["fp8"])))]:
        damaged = tmp_path / item
        shutil.copytree(ckpt, damaged)
        _flip(max((damaged / item / name).glob("[0-9]*"), key=os.path.getsize))  # a chunk file of the array
        with pytest.raises(CheckpointError, match=re.escape(f"damaged: array {name} in {damaged / item / name} ")):
            load_pretrained(damaged, dtype="float32")

    shutil.rmtree(ckpt / integrity.ITEM)  # converted before checksums were recorded: loads as before, with a warning
    with caplog.at_level("WARNING"):
        unchecked = nnx.state(load_pretrained(ckpt, dtype="float32"))
    assert "has no checksums" in caplog.text
    assert jax.tree.all(jax.tree.map(lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(), loaded, unchecked))


# --- the checkpointer: verified restore and rotation -------------------------------------------

def _state(value: float):
    """Random values: a chunk that compresses below OCDBT's inline limit would live in the b-tree."""
    return {"w": value + jax.random.normal(jax.random.key(int(value)), (64, 64)), "step": jnp.int32(value)}


def _iterator():
    return iter(grain.MapDataset.range(8).to_iter_dataset())


def test_rotation_keeps_the_intact_step_behind_a_damaged_newest(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ck"), every=1, keep=1, async_save=True)
    ckpt.save(1, _state(1.0), _iterator())
    ckpt.save(2, _state(2.0), _iterator())  # rotation waits for step 1, reads it back: intact, kept (keep=1)
    ckpt.manager.wait_until_finished()
    file, offset, length = chunks(tmp_path / "ck" / "2" / "state")["w"]
    data = bytearray(open(file, "rb").read())
    data[offset:offset + length] = bytes(length)  # zeroed: decodes to nothing valid
    open(file, "wb").write(bytes(data))
    ckpt.save(3, _state(3.0), _iterator())  # step 2 does not read back: step 1 stays
    ckpt.manager.wait_until_finished()
    assert steps_of(tmp_path / "ck") == ["1", "2", "3"]
    ckpt.save(4, _state(4.0), _iterator())  # step 3 reads back: steps 1 and 2 are older, deleted
    ckpt.close()
    assert steps_of(tmp_path / "ck") == ["3", "4"]

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(0.0))
    restored = Checkpointer(str(tmp_path / "ck"), every=1, keep=1, async_save=False).restore(abstract, _iterator())
    assert np.array_equal(restored["w"], _state(4.0)["w"])


def test_an_explicit_damaged_step_is_refused_by_name(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ck"), every=1, keep=2, async_save=False)
    ckpt.save(1, _state(1.0), _iterator())
    ckpt.close()
    file, offset, length = chunks(tmp_path / "ck" / "1" / "state")["w"]
    data = bytearray(open(file, "rb").read())
    data[offset + length - 8:offset + length] = bytes(8)
    open(file, "wb").write(bytes(data))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(0.0))
    with pytest.raises(CheckpointError, match=rf"step 1 is damaged: array w in {re.escape(file)}"):
        Checkpointer(str(tmp_path / "ck"), every=1, keep=2, async_save=False).restore(abstract, _iterator(), step=1)
    assert steps_of(tmp_path / "ck") == ["1"]  # refused, not set aside: the caller named it


def test_a_step_one_process_cannot_read_is_refused_by_every_process(tmp_path, monkeypatch):
    """Several processes, simulated: the restore's outcome is agreed (`_all_agree`) before the
    collective check; the process whose read failed first joins the barrier Orbax's restore ends with."""
    ckpt = Checkpointer(str(tmp_path / "ck"), every=1, keep=2, async_save=False)
    ckpt.save(1, _state(1.0), _iterator())
    ckpt.save(2, _state(2.0), _iterator())
    ckpt.close()
    shutil.copytree(tmp_path / "ck", tmp_path / "other")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(0.0))
    calls = []
    check = integrity.check
    monkeypatch.setattr(integrity, "check", lambda step, *a: calls.append(("check", step)) or check(step, *a))
    monkeypatch.setattr(checkpointing, "_join_orbax_restore_barrier", lambda: calls.append("barrier"))

    file, offset, length = chunks(tmp_path / "ck" / "2" / "state")["w"]
    with open(file, "r+b") as f:
        f.truncate(offset + length // 2)  # this process's chunk of step 2 cannot be read
    monkeypatch.setattr(checkpointing, "_all_agree", lambda ok: calls.append(ok) or ok)
    with pytest.raises(CheckpointError, match=rf"step 2 is damaged: array w in {re.escape(file)}"):
        Checkpointer(str(tmp_path / "ck"), every=1, keep=2, async_save=False).restore(abstract, _iterator(), step=2)
    assert calls == ["barrier", False]

    calls.clear()  # another process, which read step 2 intact: told step 2 failed elsewhere, it falls back too
    agreed = iter([False, True])
    monkeypatch.setattr(checkpointing, "_all_agree", lambda ok: calls.append(ok) or next(agreed))
    restored = Checkpointer(str(tmp_path / "other"), every=1, keep=2, async_save=False).restore(abstract, _iterator())
    assert calls == [True, True, ("check", 1)]  # no collective check of step 2
    assert np.array_equal(restored["w"], _state(1.0)["w"]) and steps_of(tmp_path / "other") == ["1", "2.damaged"]


# --- a damaged run through the public entry points ---------------------------------------------

def _resume(run_dir, compile_cache):
    return run_train(run_dir, *RESUME_FLAGS, f"--steps={STEPS}", cache_dir=compile_cache)


def test_resume_refuses_a_flipped_step_and_continues_like_the_uninterrupted_run(run_copy, compile_cache):
    before = steps_of(run_copy / "checkpoints")
    newest = max(int(s) for s in before)
    file = damage(run_copy / "checkpoints" / str(newest), "flip")
    uninterrupted = read_records(run_copy)
    result = _resume(run_copy, compile_cache)
    refused = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert len(refused) == 1 and f"checkpoint step {newest} is damaged: array {ARRAY} in {file}" in refused[0], \
        result.stderr[-3000:]
    previous = sorted(int(s) for s in before)[-2]
    assert f"at step {previous}" in result.stderr
    assert f"step {previous + 1}/{STEPS}" in result.stderr  # trained again from there
    after = read_records(run_copy)  # the resume drops the lines of steps > its start and writes them anew
    assert [r["step"] for r in after] == [r["step"] for r in uninterrupted]
    assert [r["loss"] for r in after] == [r["loss"] for r in uninterrupted]
    assert set(before) <= set(steps_of(run_copy / "checkpoints")) and f"{newest}.damaged" in steps_of(run_copy / "checkpoints")  # nothing deleted


def test_a_truncated_array_file_is_one_line_naming_step_array_and_file(run_copy, compile_cache, capsys):
    newest = max(int(s) for s in steps_of(run_copy / "checkpoints"))
    file = damage(run_copy / "checkpoints" / str(newest), "truncate")
    cut = {name for name, (where, offset, length) in chunks(run_copy / "checkpoints" / str(newest) / "state").items()
           if where == file and offset + length > os.path.getsize(file)}  # the file holds several arrays
    named = re.compile(rf"checkpoint step {newest} is damaged: array (\S+) in {re.escape(file)} does not read back")

    def names_a_cut_array(line: str) -> bool:
        return named.search(line).group(1) in cut

    with pytest.raises(CheckpointError) as err:
        load_pretrained(run_copy)
    assert "\n" not in str(err.value) and names_a_cut_array(str(err.value)), err.value

    assert convert_main(["--no-progress", "--to-hf", f"--ckpt={run_copy}", f"--out={run_copy / 'hf'}"]) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("error: ") and names_a_cut_array(printed[0]), printed

    gen = run([sys.executable, "-m", "experiments.generate", f"--checkpoint={run_copy}", "--prompt=Once",
               "--max_new_tokens=2"], repo_env(), timeout=600)
    errors = [line for line in gen.stderr.splitlines() if named.search(line)]
    assert gen.returncode == 2 and "Traceback" not in gen.stderr and len(errors) == 1, gen.stderr[-3000:]
    assert errors[0].startswith("error: ") and names_a_cut_array(errors[0])

    result = _resume(run_copy, compile_cache)
    refused = [line for line in result.stderr.splitlines() if named.search(line)]
    assert len(refused) == 1 and names_a_cut_array(refused[0]), result.stderr[-3000:]
    assert read_records(run_copy)[-1]["step"] == STEPS  # resumed from the step before, trained to the end

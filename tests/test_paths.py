"""dsv3_jax/paths.py: URLs stay URLs (no os.path on them), local paths become absolute."""

import os

from dsv3_jax import paths


def test_urls_are_kept_and_joined_as_urls():
    assert paths.resolve("gs://bucket/run/") == "gs://bucket/run"
    assert paths.join("gs://bucket/run", "checkpoints", "2") == "gs://bucket/run/checkpoints/2"
    assert paths.parent("gs://bucket/run/checkpoints") == "gs://bucket/run"
    assert paths.name("gs://bucket/run/checkpoints/2") == "2"
    assert paths.display("gs://bucket/run") == "gs://bucket/run"


def test_local_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.resolve("runs/a") == os.path.join(str(tmp_path), "runs", "a")
    assert paths.display(paths.resolve("runs/a")) == os.path.join("runs", "a")


def test_tensorstore_kvstore_follows_the_scheme(tmp_path):
    assert paths.kvstore("gs://bucket/run/state") == {"driver": "gcs", "bucket": "bucket", "path": "run/state/"}
    assert paths.kvstore(tmp_path / "state") == {"driver": "file", "path": f"{tmp_path}/state/"}


def test_local_files_round_trip(tmp_path):
    target = paths.join(tmp_path, "a", "b.json")
    paths.makedirs(paths.parent(target))
    paths.write_text(target, "{}")
    assert paths.at(target).read_text() == "{}"

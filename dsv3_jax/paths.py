"""Where a run's files live: a local path or a URL (`gs://bucket/run`), the same way end to end.

A pod's hosts share no disk, so a run's work directory is a URL into an object store: every host
reads and writes the same checkpoints, and `generate`, `convert` and `serve` read the run from
there. Python file operations go through etils `epath` (gcsfs for `gs://`, from the `gcs` extra;
s3fs for `s3://`), array data through tensorstore's kvstore driver for the same URL (`gcs` for
`gs://`). A local path is made absolute (a relative one means the directory the command ran in);
a URL is kept as given, never passed through `os.path`.

Object stores have no append and no rename: `write_text` replaces a whole object.

Pointing at a local emulator (the tests do this with `gcp-storage-emulator`): STORAGE_EMULATOR_HOST
for gcsfs and the google client (TensorBoard), TENSORSTORE_GCS_HTTP_URL for tensorstore (its
documented way to reach another server than storage.googleapis.com).
"""

from __future__ import annotations

import os
import re

from etils import epath

from dsv3_jax import require_extra

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_url(path: str | os.PathLike) -> bool:
    return bool(_URL.match(os.fspath(path)))


def resolve(path: str | os.PathLike) -> str:
    """A URL as given (trailing '/' dropped), a local path absolute."""
    path = os.fspath(path)
    if is_url(path):
        return path.rstrip("/") if not path.endswith("://") else path
    return os.path.abspath(os.path.expanduser(path))


def at(path: str | os.PathLike) -> epath.Path:
    """The `epath.Path` for `path` (after `resolve`): open, read_text, exists, iterdir, mkdir."""
    path = resolve(path)
    if path.startswith("gs://"):
        require_extra("gcs", "gcsfs", "google.cloud.storage", needed_by=path)
    return epath.Path(path)


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base/part/...` as a string, for a URL or a local path."""
    return os.fspath(at(base).joinpath(*parts)) if parts else resolve(base)


def parent(path: str | os.PathLike) -> str:
    return os.fspath(at(path).parent)


def name(path: str | os.PathLike) -> str:
    return at(path).name


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replaces a small file whole, in one step: a reader sees the old file or the new one, never a
    truncated one (a checkpoint's marker files, a run's model_config.json read by the other processes
    while process 0 rewrites it). On a local disk it writes a temporary file, fsyncs it and renames
    it over `path`; an object store's writes are whole objects already."""
    if is_url(path):
        at(path).write_text(text)
        return
    path = resolve(path)
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def makedirs(path: str | os.PathLike) -> None:
    at(path).mkdir(parents=True, exist_ok=True)  # object stores: nothing to make


def kvstore(directory: str | os.PathLike) -> dict:
    """The tensorstore kvstore spec of a directory (its path ends in '/': tensorstore joins keys
    literally): `file` for a local path, the URL's own driver (e.g. `gcs`) for a URL."""
    directory = resolve(directory)
    if not is_url(directory):
        return {"driver": "file", "path": directory + "/"}
    import tensorstore as ts

    return ts.KvStore.Spec(directory + "/").to_json()


def display(path: str | os.PathLike) -> str:
    """For messages: a local path relative to the current directory, a URL as it is."""
    path = os.fspath(path)
    return path if is_url(path) else os.path.relpath(path)

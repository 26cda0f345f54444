"""Document sources: random-access lists of documents the grain pipeline reads by index.

Two kinds, both `grain.RandomAccessDataSource`s (`__len__`, `__getitem__`):

- `TextSource`: raw text documents held in memory, from the bundled corpus or user files:
  `.txt` - documents are separated by one or more blank lines (a file without blank lines is one
  document); `.jsonl` - one JSON object per line, the document is its `text_field` (default
  "text"), blank lines are skipped. Fit for demo- to GB-scale text; tokenized lazily.
- `TokenSource`: pre-tokenized documents in ArrayRecord shards written by
  `experiments/prepare_data.py`: one record per document, little-endian int32 token ids, each
  shard with a `<shard>.json` sidecar (record/token counts and the largest id).

Bad data fails when the source is opened, naming the file: a missing or empty file, a file with no
documents, an unreadable or non-object JSON line or a missing/non-string text field (file:line),
a shard whose sidecar reports an id >= vocab_size (file and record). Shards without a sidecar are
checked per record as they are read (file and record in the error).
"""

import bisect
import glob
import json
import os
import pathlib
import re
from collections.abc import Sequence

import numpy as np

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
RECORD_SUFFIXES = (".arrayrecord", ".array_record")
TOKEN_DTYPE = np.dtype("<i4")

_BLANK_LINES = re.compile(r"\n[ \t\r]*\n")


class DataError(ValueError):
    """Bad input data; the message names the file (and line or record)."""


def encode_tokens(ids) -> bytes:
    """Serialises one document's token ids to an ArrayRecord record."""
    return np.asarray(ids, dtype=TOKEN_DTYPE).tobytes()


def sidecar_path(shard: str) -> str:
    return f"{shard}.json"


class TextSource:
    """Text documents in memory; `where(i)` says which file and line document `i` came from."""

    def __init__(self, documents: Sequence[str], origins: Sequence[str]):
        assert len(documents) == len(origins)
        self._documents, self._origins = list(documents), list(origins)

    def __len__(self) -> int:
        return len(self._documents)

    def __getitem__(self, index) -> str:
        return self._documents[index]

    def where(self, index: int) -> str:
        return self._origins[index]

    def __repr__(self) -> str:
        return f"TextSource({len(self)} documents)"


class TokenSource:
    """Pre-tokenized documents in ArrayRecord shards; item i is int32 [num_tokens].

    Args:
      paths: shard files, read in the given order.
      vocab_size: if given, every token id must be below it; checked from the sidecars at
        construction and, for shards without one, on each read.
    """

    def __init__(self, paths: Sequence[str], vocab_size: int | None = None):
        # Imported here so that text-only users never load the ArrayRecord extension.
        from array_record.python import array_record_module
        import grain

        self._paths = [str(p) for p in paths]
        self._vocab_size = vocab_size
        counts, self._checked = [], []
        for path in self._paths:
            meta = _read_sidecar(path)
            try:
                reader = array_record_module.ArrayRecordReader(path)
                num = reader.num_records()
                reader.close()
            except Exception as e:  # The C++ reader raises bare RuntimeErrors.
                raise DataError(f"{path}: not a readable ArrayRecord file ({e}).") from e
            if num == 0:
                raise DataError(f"{path}: ArrayRecord shard holds no documents.")
            if meta is not None and vocab_size is not None and meta["max_token_id"] >= vocab_size:
                raise DataError(
                    f"{path}: record {meta['max_token_record']} holds token id {meta['max_token_id']} >= "
                    f"{vocab_size=}; the shard was made with another tokenizer.")
            counts.append(num)
            self._checked.append(meta is not None)
        self._ends = np.cumsum(counts).tolist()
        self._reader = grain.sources.ArrayRecordDataSource(self._paths)

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, index) -> np.ndarray:
        tokens = np.frombuffer(self._reader[index], dtype=TOKEN_DTYPE).astype(np.int32)  # `encode_tokens`' bytes
        if self._vocab_size is not None and tokens.size:
            shard = bisect.bisect_right(self._ends, index)
            if not self._checked[shard] and (tokens.max() >= self._vocab_size or tokens.min() < 0):
                bad = tokens[(tokens >= self._vocab_size) | (tokens < 0)][0]
                raise DataError(f"{self.where(index)}: token id {bad} is outside [0, {self._vocab_size}).")
        return tokens

    def where(self, index: int) -> str:
        shard = bisect.bisect_right(self._ends, index)
        start = self._ends[shard - 1] if shard else 0
        return f"{self._paths[shard]} record {index - start}"

    def __repr__(self) -> str:
        return f"TokenSource({len(self._paths)} shards, {len(self)} documents)"


def read_text_file(path: str) -> list[tuple[str, str]]:
    """(document, origin) of each block between blank lines of a `.txt` file."""
    text = _read_nonempty(path)
    docs = [d.strip("\n") for d in _BLANK_LINES.split(text.replace("\r\n", "\n")) if d.strip()]
    if not docs:
        raise DataError(f"{path}: no documents (only whitespace).")
    return [(doc, f"{path} document {i}") for i, doc in enumerate(docs)]


def read_jsonl_file(path: str, text_field: str = "text") -> list[tuple[str, str]]:
    """(document, "file:line") of each non-blank line of a `.jsonl` file."""
    docs = []
    for where, obj in json_lines(path):
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            raise DataError(f"{where}: expected an object with a string field {text_field!r}.")
        if obj[text_field].strip():
            docs.append((obj[text_field], where))
    if not docs:
        raise DataError(f"{path}: no documents (no non-empty {text_field!r} field).")
    return docs


def json_lines(path: str):
    """("file:line", object) of each non-blank line of a `.jsonl` file (at least one: an empty file
    fails); a line that is not JSON fails naming file:line."""
    for line_no, line in enumerate(_read_nonempty(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{line_no}", json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: unreadable JSON line ({e.msg}).") from e


def expand_paths(patterns: str | Sequence[str]) -> list[str]:
    """Expands globs (comma-separated or a list) to a sorted, de-duplicated file list."""
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [p for p in str(patterns).split(",") if p]
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(str(pattern))))
        if not matches:
            raise DataError(f"{pattern}: no files match.")
        paths.extend(m for m in matches if m not in paths)
    return paths


def open_source(data=None, *, text_field: str = "text", vocab_size: int | None = None):
    """Opens the documents named by `data`.

    Args:
      data: None for the bundled fortune corpus; else a glob, comma-separated globs, or a list
        of them, matching `.txt`/`.jsonl` files or `.arrayrecord` shards (not both kinds).
      text_field: the JSON field that holds a document in `.jsonl` files.
      vocab_size: the tokenizer's vocab size, checked against pre-tokenized shards.

    Returns:
      A `TextSource` or a `TokenSource`.
    """
    if data is None:
        from dsv3_jax.data import corpus
        docs = corpus.fortune_documents()
        return TextSource(docs, [f"{corpus.DISTRIBUTION} document {i}" for i in range(len(docs))])
    paths = expand_paths(data)
    unknown = [p for p in paths if not p.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + RECORD_SUFFIXES)]
    if unknown:
        raise DataError(f"{unknown[0]}: unknown file type; expected .txt, .jsonl or .arrayrecord.")
    shards = [p.endswith(RECORD_SUFFIXES) for p in paths]
    if any(shards):
        if not all(shards):
            raise DataError(f"{data}: mixes ArrayRecord shards with text files; run prepare_data.")
        return TokenSource(paths, vocab_size=vocab_size)
    pairs = []  # (document, origin)
    for path in paths:
        pairs += read_jsonl_file(path, text_field) if path.endswith(JSONL_SUFFIXES) else read_text_file(path)
    documents, origins = zip(*pairs)
    return TextSource(documents, origins)


def _read_nonempty(path: str) -> str:
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read as UTF-8 text ({e}).") from e
    if not text.strip():
        raise DataError(f"{path}: file is empty.")
    return text


def _read_sidecar(shard: str) -> dict | None:
    path = sidecar_path(shard)
    if not os.path.exists(path):
        return None
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable shard metadata ({e}); delete it or rerun prepare_data.")

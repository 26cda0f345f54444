"""Corpus and file sources; every bad-data case fails early with the file (and line/record)."""

import json
import re

import numpy as np
import pytest
from array_record.python import array_record_module

from dsv3_jax.data import DataConfig, make_dataset
from dsv3_jax.data import corpus, sources


def test_bundled_corpus_is_clean_and_deterministic():
    docs = corpus.fortune_documents()
    assert len(docs) > 14_000
    assert all(d.strip() and "$FreeBSD$" not in d for d in docs)
    assert not any(re.search(r"^%+\s*$", d, flags=re.M) for d in docs)
    corpus.fortune_documents.cache_clear()
    assert corpus.fortune_documents() == docs
    assert "FORTUNE-COOKIE" in docs[0]


def test_parse_fortunes():
    text = "%% comment\nfirst\nline\n%\n\n%\nsecond\n%\n"
    assert corpus.parse_fortunes(text) == ["first\nline", "second"]


def test_text_and_jsonl_files(tmp_path):
    (tmp_path / "a.txt").write_text("one\nstill one\n\n\n  \ntwo\n\nthree")
    (tmp_path / "b.jsonl").write_text('{"text": "four"}\n\n{"body": "five", "text": "six"}\n')
    src = sources.open_source(str(tmp_path / "*"))
    assert [src[i] for i in range(len(src))] == ["one\nstill one", "two", "three", "four", "six"]
    assert src.where(4) == f"{tmp_path / 'b.jsonl'}:3"
    with pytest.raises(sources.DataError, match=r"b.jsonl:1: .*'body'"):
        sources.open_source(str(tmp_path / "b.jsonl"), text_field="body")


@pytest.mark.parametrize("name, content, message", [
    ("empty.txt", "", "file is empty"),
    ("blank.txt", "\n  \n\t\n", "file is empty"),
    ("empty.jsonl", "", "file is empty"),
    ("bad.jsonl", '{"text": "ok"}\n{"text": "oops"\n', r"bad.jsonl:2: unreadable JSON"),
    ("field.jsonl", '{"text": "ok"}\n\n{"txt": "x"}\n', r"field.jsonl:3: .*'text'"),
    ("notobj.jsonl", '["text"]\n', r"notobj.jsonl:1"),
    ("nodocs.jsonl", '{"text": "  "}\n', r"nodocs.jsonl: no documents"),
    ("latin1.txt", b"caf\xe9", r"latin1.txt: cannot read as UTF-8"),
    ("data.csv", "a,b", r"data.csv: unknown file type"),
])
def test_bad_text_files_name_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(sources.DataError, match=message) as info:
        sources.open_source(str(path))
    assert str(path) in str(info.value)


def test_missing_glob(tmp_path):
    with pytest.raises(sources.DataError, match="no files match"):
        sources.open_source(str(tmp_path / "nothing*.jsonl"))


def _write_shard(path, docs, sidecar=None):
    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    for ids in docs:
        writer.write(sources.encode_tokens(ids))
    writer.close()
    if sidecar is not None:
        (path.parent / (path.name + ".json")).write_text(json.dumps(sidecar))
    return str(path)


def test_token_source_reads_shards_in_order(tmp_path):
    a = _write_shard(tmp_path / "a.arrayrecord", [[5, 6, 7], [8]])
    b = _write_shard(tmp_path / "b.arrayrecord", [[], [9, 10]])
    src = sources.open_source(str(tmp_path / "*.arrayrecord"), vocab_size=2048)
    assert [src[i].tolist() for i in range(4)] == [[5, 6, 7], [8], [], [9, 10]]
    assert src[0].dtype == np.int32
    assert (src.where(1), src.where(3)) == (f"{a} record 1", f"{b} record 1")


def test_empty_shard_names_the_file(tmp_path):
    path = _write_shard(tmp_path / "empty.arrayrecord", [])
    with pytest.raises(sources.DataError, match=f"{path}: ArrayRecord shard holds no documents"):
        sources.open_source(path)
    garbage = tmp_path / "garbage.arrayrecord"
    garbage.write_bytes(b"not an array record")
    with pytest.raises(sources.DataError, match=f"{garbage}: not a readable ArrayRecord"):
        sources.open_source(str(garbage))


def test_out_of_vocab_from_sidecar_fails_at_open(tmp_path):
    meta = {"num_records": 2, "num_tokens": 4, "max_token_id": 4000, "max_token_record": 1}
    path = _write_shard(tmp_path / "big.arrayrecord", [[1, 2], [3, 4000]], sidecar=meta)
    with pytest.raises(sources.DataError, match=f"{path}: record 1 holds token id 4000"):
        sources.open_source(path, vocab_size=2048)


def test_out_of_vocab_without_sidecar_fails_in_the_pipeline(tmp_path):
    good = [[7] * 20 for _ in range(50)]
    path = _write_shard(tmp_path / "bad.arrayrecord", good[:37] + [[3, 2048, 4]] + good[37:])
    ds = make_dataset(DataConfig(seq_len=32, batch_size=2, data=path, eval_fraction=0.02,
                                 num_epochs=1), process_index=0, process_count=1)
    with pytest.raises(sources.DataError, match=f"{path} record 37: token id 2048"):
        for _ in ds:
            pass

"""experiments/prepare_data.py writes ArrayRecord shards the pipeline reads back unchanged."""

import io
import json

import numpy as np
import pytest

from dsv3_jax.data import DataConfig, make_dataset, sources
from experiments import prepare_data


def test_round_trip_through_array_record(tmp_path, jsonl_path, docs, tokenizer):
    progress = io.StringIO()
    out = tmp_path / "shards"
    paths = prepare_data.prepare(jsonl_path, out, shard_size=100, progress=progress)
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        f"data-0000{i}-of-00003.arrayrecord" for i in range(3)]
    assert "docs/s" in progress.getvalue() and "ETA" in progress.getvalue()
    assert f"{len(docs)}/{len(docs)} docs" in progress.getvalue()

    src = sources.open_source(str(out / "*.arrayrecord"), vocab_size=tokenizer.vocab_size)
    assert len(src) == len(docs)
    for i in (0, 99, 100, 150, len(docs) - 1):
        assert src[i].tolist() == tokenizer.encode(docs[i])
    meta = json.loads((out / "data-00001-of-00003.arrayrecord.json").read_text())
    assert meta["num_records"] == 100 and meta["vocab_size"] == 2048

    # Same documents, same seed: the token pipeline yields exactly the text pipeline's batches.
    def batches(data):
        cfg = DataConfig(seq_len=64, batch_size=4, data=data, eval_fraction=0.05, num_epochs=1)
        return list(make_dataset(cfg, process_index=0, process_count=1))

    from_text, from_records = batches(jsonl_path), batches(str(out / "*.arrayrecord"))
    assert len(from_text) == len(from_records) > 0
    for a, b in zip(from_text, from_records):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_cli_and_refusals(tmp_path, jsonl_path, capsys):
    out = tmp_path / "cli"
    assert prepare_data.main([f"--input={jsonl_path}", f"--output={out}", "--shard_size=1000"]) == 0
    assert "wrote 1 shards" in capsys.readouterr().out
    assert prepare_data.main([f"--input={jsonl_path}", f"--output={out}"]) == 2
    assert "already holds" in capsys.readouterr().err
    assert prepare_data.main([f"--input={out}/*.arrayrecord", f"--output={tmp_path / 'again'}"]) == 2
    assert "already tokenized" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert prepare_data.main([f"--input={empty}", f"--output={tmp_path / 'x'}"]) == 2
    assert f"{empty}: file is empty" in capsys.readouterr().err

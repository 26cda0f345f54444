"""Packing, shuffling, sharding, splitting and resuming of the grain pipeline."""

import collections
import json

import numpy as np
import pytest

from dsv3_jax.data import DataConfig, make_dataset, make_train_and_eval, split_indices
from dsv3_jax.data import pipeline, sources

SEQ_LEN = 64


def _config(jsonl_path, **kw):
    kw = {"seq_len": SEQ_LEN, "batch_size": 4, "data": jsonl_path, "eval_fraction": 0.05, **kw}
    return DataConfig(**kw)


def _batches(ds, n=None):
    it = iter(ds)
    return [next(it) for _ in range(n)] if n is not None else list(it)


def _segments(batches):
    """Multiset of the token runs (one per segment) in packed rows."""
    runs = collections.Counter()
    for b in batches:
        for toks, seg in zip(b["tokens"], b["segment_ids"]):
            for s in range(1, seg.max() + 1):
                runs[tuple(toks[seg == s])] += 1
    return runs


def _expected_chunks(docs, tokenizer, indices, add_bos=False):
    """The same multiset, from the source documents directly."""
    runs = collections.Counter()
    for i in indices:
        ids = ([tokenizer.bos_id] if add_bos else []) + tokenizer.encode(docs[i]) + [tokenizer.eos_id]
        for start in range(0, len(ids), SEQ_LEN):
            runs[tuple(ids[start:start + SEQ_LEN])] += 1
    return runs


def _assert_rows_consistent(batch, pad_id):
    assert set(batch) == {"tokens", "segment_ids", "positions"}
    for v in batch.values():
        assert v.dtype == np.int32 and v.shape == batch["tokens"].shape
    for toks, seg, pos in zip(batch["tokens"], batch["segment_ids"], batch["positions"]):
        used = int((seg > 0).sum())
        assert (seg[:used] > 0).all() and (seg[used:] == 0).all()  # Padding only at the end.
        assert (toks[used:] == pad_id).all() and (pos[used:] == 0).all()
        starts = np.flatnonzero(np.diff(seg[:used], prepend=0))
        assert (seg[starts] == np.arange(1, len(starts) + 1)).all()  # Segments number 1, 2, 3, ...
        for s, start in enumerate(starts, start=1):
            length = int((seg == s).sum())
            np.testing.assert_array_equal(pos[start:start + length], np.arange(length))


def test_batch_format_and_row_consistency(jsonl_path, tokenizer):
    batches = _batches(make_dataset(_config(jsonl_path), process_index=0, process_count=1), 30)
    for b in batches:
        assert b["tokens"].shape == (4, SEQ_LEN)
        _assert_rows_consistent(b, tokenizer.pad_id)
    assert max(b["segment_ids"].max() for b in batches) > 1  # Rows do hold several documents.
    fill = np.mean([(b["segment_ids"] > 0).mean() for b in batches])
    assert fill > 0.85, f"packing leaves {1 - fill:.0%} padding"


@pytest.mark.parametrize("add_bos", [False, True])
def test_epoch_has_every_document_once(jsonl_path, tokenizer, docs, add_bos):
    # batch_size 1, so no partial batch is dropped at the end of the epoch.
    cfg = _config(jsonl_path, batch_size=1, num_epochs=1, add_bos=add_bos)
    batches = _batches(make_dataset(cfg, process_index=0, process_count=1))
    got = _segments(batches)
    train = split_indices(len(docs), 0.05)["train"]
    assert got == _expected_chunks(docs, tokenizer, train, add_bos)
    for b in batches:
        _assert_rows_consistent(b, tokenizer.pad_id)
    bos = [tokenizer.bos_id] if add_bos else []
    long_doc = bos + tokenizer.encode(docs[max(train)]) + [tokenizer.eos_id]
    assert len(long_doc) > 3 * SEQ_LEN
    assert tuple(long_doc[SEQ_LEN:2 * SEQ_LEN]) in got  # A middle chunk, as its own segment.


def test_eval_split_is_disjoint_finite_and_padded(jsonl_path, tokenizer, docs):
    split = split_indices(len(docs), 0.05)
    assert not set(split["train"]) & set(split["eval"])
    assert len(split["train"]) + len(split["eval"]) == len(docs)
    assert 0.01 < len(split["eval"]) / len(docs) < 0.12
    train, evals = make_train_and_eval(_config(jsonl_path, num_epochs=1), process_index=0,
                                       process_count=1)
    eval_batches = _batches(evals)  # Finite: the iterator stops.
    assert _segments(eval_batches) == _expected_chunks(docs, tokenizer, split["eval"])
    assert not set(_segments(eval_batches)) & set(_segments(_batches(train)))
    assert all(b["tokens"].shape == (4, SEQ_LEN) for b in eval_batches)
    assert _batches(evals)[0]["tokens"].tolist() == eval_batches[0]["tokens"].tolist()


def test_bundled_corpus_split_fraction():
    split = split_indices(14739, 0.01)
    assert 0.008 < len(split["eval"]) / 14739 < 0.012
    np.testing.assert_array_equal(split["eval"], split_indices(14739, 0.01)["eval"])


def test_shuffle_is_seeded(jsonl_path):
    def first(seed):
        ds = make_dataset(_config(jsonl_path, seed=seed), process_index=0, process_count=1)
        return np.stack([b["tokens"] for b in _batches(ds, 5)])

    np.testing.assert_array_equal(first(3), first(3))
    assert not np.array_equal(first(3), first(4))


def test_epochs_are_reshuffled(jsonl_path):
    one = _batches(make_dataset(_config(jsonl_path, batch_size=1, num_epochs=1),
                                process_index=0, process_count=1))
    two = _batches(make_dataset(_config(jsonl_path, batch_size=1, num_epochs=2),
                                process_index=0, process_count=1))
    assert _segments(two) == collections.Counter({k: 2 * v for k, v in _segments(one).items()})
    n = len(one)
    assert [b["tokens"].tolist() for b in two[n + 2:2 * n - 2]] != \
        [b["tokens"].tolist() for b in one[2:n - 2]]


def test_processes_hold_disjoint_rows_of_one_process_batch(jsonl_path):
    """Each of 2 processes reads batch_size rows; together they are the batch_size x 2 rows one
    process reads, batch after batch, and no row is in both."""
    def batches(index, count, batch_size):
        return _batches(make_dataset(_config(jsonl_path, batch_size=batch_size, num_epochs=1),
                                     process_index=index, process_count=count))

    zero, one, alone = batches(0, 2, 3), batches(1, 2, 3), batches(0, 1, 6)
    assert len(zero) == len(one) == len(alone) > 2
    for a, b, both in zip(zero, one, alone):
        for k in both:
            assert a[k].shape[0] == b[k].shape[0] == 3
            np.testing.assert_array_equal(np.concatenate([a[k], b[k]]), both[k])
        assert not {r.tobytes() for r in a["tokens"]} & {r.tobytes() for r in b["tokens"]}
    with pytest.raises(ValueError, match="process_index"):
        make_dataset(_config(jsonl_path), process_index=2, process_count=2)


@pytest.mark.parametrize("skip", [0, 7, 61])  # 61 batches cross the first epoch boundary.
def test_get_state_set_state_resumes_exactly(jsonl_path, skip):
    ds = make_dataset(_config(jsonl_path), process_index=0, process_count=1)
    it = iter(ds)
    for _ in range(skip):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # What a checkpoint stores.
    want = [next(it) for _ in range(3)]
    resumed = iter(make_dataset(_config(jsonl_path), process_index=0, process_count=1))
    resumed.set_state(state)
    for w in want:
        got = next(resumed)
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])


def test_orbax_composite_checkpoint(jsonl_path, tmp_path):
    import grain
    import orbax.checkpoint as ocp
    it = iter(make_dataset(_config(jsonl_path), process_index=0, process_count=1))
    for _ in range(5):
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(5, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"w": np.arange(3.0)}),
            data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
    want = next(it)
    fresh = iter(make_dataset(_config(jsonl_path), process_index=0, process_count=1))
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        restored = mngr.restore(5, args=ocp.args.Composite(
            state=ocp.args.StandardRestore({"w": np.zeros(3)}),
            data=grain.checkpoint.CheckpointRestore(fresh)))
    np.testing.assert_array_equal(restored.state["w"], np.arange(3.0))
    np.testing.assert_array_equal(next(restored.data)["tokens"], want["tokens"])


def test_worker_processes_match_and_resume(jsonl_path):
    cfg = _config(jsonl_path, num_workers=1)
    it = iter(make_dataset(cfg, process_index=0, process_count=1))
    for _ in range(3):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(2)]
    resumed = iter(make_dataset(cfg, process_index=0, process_count=1))
    resumed.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(resumed)["tokens"], w["tokens"])


def test_bundled_defaults(tokenizer):
    train, evals = make_train_and_eval(DataConfig(seq_len=33, batch_size=2), process_index=0,
                                       process_count=1)
    batch = next(iter(train))
    assert batch["tokens"].shape == (2, 33)
    assert tokenizer.decode(batch["tokens"][0][batch["segment_ids"][0] == 1]).strip()
    assert next(iter(evals))["tokens"].shape == (2, 33)


@pytest.mark.parametrize("field, value", [("seq_len", 1), ("batch_size", 0),
                                          ("eval_fraction", 0.0), ("num_workers", -1)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"DataConfig.{field}"):
        DataConfig(**{"seq_len": 8, "batch_size": 1, field: value})


def test_too_few_documents(tmp_path):
    (tmp_path / "one.txt").write_text("only one document")
    with pytest.raises(sources.DataError, match="at least 2 documents"):
        make_dataset(DataConfig(seq_len=8, batch_size=1, data=str(tmp_path / "one.txt")),
                     process_index=0, process_count=1)

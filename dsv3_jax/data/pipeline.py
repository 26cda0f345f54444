"""The training and eval input pipelines (grain), from documents to packed batches.

    documents (TextSource | TokenSource)
      -> held-out split: a fixed ~eval_fraction of documents, chosen by a hash of the document
         index (independent of `seed`, so the eval set never moves), disjoint from train
      -> train only: seeded shuffle, reshuffled every epoch; repeat (num_epochs, None = forever)
      -> tokenize: [BOS] + ids + EOS per document
      -> split documents longer than seq_len into chunks of seq_len (each chunk its own segment)
      -> first-fit pack into rows of seq_len (grain FirstFitPackIterDataset)
      -> batch: the global batch of batch_size x process_count rows (train drops the last partial
         batch; eval pads it with all-padding rows), of which this process keeps its own
         batch_size consecutive rows (`_process_rows`): processes hold disjoint rows whose union is
         exactly the batch one process with batch_size x process_count would read, so a run's
         data (and loss curve) does not depend on how many hosts it is spread over. The price:
         every host tokenizes and packs the global stream (cheap beside a step; pretokenized
         TokenSource data makes it negligible).
      -> optional worker processes (`num_workers` > 0; 0 runs in the calling process)

Chat data (`format="chat"`, `chat.py`): conversations instead of documents, each rendered by the
chat template into tokens and a loss mask, never split (one longer than a row is left out), packed
whole by the same first-fit packing, one segment each.

Every batch is a dict of int32 numpy arrays, each [batch_size, seq_len]:

    tokens       token ids; padding holds pad_id
    segment_ids  1, 2, 3, ... per document (chunk, conversation) within a row; 0 for padding
    positions    0, 1, 2, ... restarting at each segment start; 0 for padding
    loss_mask    chat only: 1 where the token is assistant text (a target the loss counts), else 0

The trainer asks for seq_len = T + 1 and derives inputs `tokens[:, :-1]`, targets
`tokens[:, 1:]`, and masks from the segment ids itself.

Checkpointing: the train iterator is a `grain.DatasetIterator`; `iterator.get_state()` is a small
JSON-able dict, and `set_state` resumes at exactly the next batch (same config, same
process_count and num_workers). Inside an Orbax `CheckpointManager`, save it next to the train
state with `ocp.args.Composite(state=..., data=grain.checkpoint.CheckpointSave(iterator))` and
restore with `grain.checkpoint.CheckpointRestore(iterator)` (one JSON file per process).
"""

import dataclasses
import functools

import grain
import jax
import numpy as np
from absl import flags

from dsv3_jax.data import chat as chat_lib
from dsv3_jax.data import sources as sources_lib
from dsv3_jax.data import tokenizer as tokenizer_lib

FORMATS = ("text", "chat")
_SPLIT_SALT = np.uint64(0x5EED_0F_E7A1)
_SPLIT_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to read and how to batch it; every field is checked once, in `__post_init__`."""

    seq_len: int  # Row length in tokens; the trainer asks for T + 1.
    batch_size: int  # Rows per batch on this process (the global batch is batch_size x process_count).
    data: str | tuple[str, ...] | None = None  # None: bundled fortunes; else globs (sources.py).
    tokenizer: str | None = None  # tokenizer.json or HF folder; None: the bundled 2048-id BPE.
    text_field: str = "text"  # JSON field that holds a document in .jsonl files.
    add_bos: bool = False  # Prepend BOS to every document (EOS is always appended).
    eval_fraction: float = 0.01  # Share of documents held out for eval.
    seed: int = 0  # Shuffle and bin-order seed.
    num_epochs: int | None = None  # Train epochs; None repeats forever.
    num_packing_bins: int | None = None  # First-fit window in rows; None: 4 x the global batch.
    num_workers: int = 0  # grain worker processes; 0 runs in the calling process.
    format: str = "text"  # "text": documents, every token a target; "chat": conversations (chat.py).
    chat_template: str | None = None  # chat: a template file; None: the tokenizer's own template.

    def __post_init__(self):
        checks = {
            "format": self.format in FORMATS,
            "seq_len": self.seq_len >= 2,
            "batch_size": self.batch_size >= 1,
            "eval_fraction": 0.0 < self.eval_fraction < 1.0,
            "num_epochs": self.num_epochs is None or self.num_epochs >= 1,
            "num_packing_bins": self.num_packing_bins is None or self.num_packing_bins >= 1,
            "num_workers": self.num_workers >= 0,
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"DataConfig.{field}={getattr(self, field)!r} is out of range.")


def make_dataset(config: DataConfig, split: str = "train", *, tokenizer=None,
                 process_index: int | None = None,
                 process_count: int | None = None) -> grain.IterDataset:
    """Returns the packed, batched dataset of one split for this process.

    Args:
      config: a `DataConfig`.
      split: "train" (shuffled, repeated per `num_epochs`) or "eval" (in order, one pass).
      tokenizer: a `tokenizer.Tokenizer`; None loads `config.tokenizer`.
      process_index, process_count: this process's shard; None asks JAX.

    Returns:
      A `grain.IterDataset` of batches (see the module docstring). `iter(ds)` gives a
      checkpointable `grain.DatasetIterator`.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"{split=} must be 'train' or 'eval'.")
    tok = tokenizer or tokenizer_lib.load_tokenizer(config.tokenizer)
    chat = config.format == "chat"
    if chat:  # rendered with its loss mask; never split
        chat_tok = chat_lib.chat_tokenizer(config.tokenizer, config.chat_template)
        fan_out = functools.partial(chat_lib.encode_fitting, chat_tok, config.seq_len)
        source = chat_lib.open_chat_source(config.data)
    else:
        fan_out = functools.partial(_document_chunks, tok, config.add_bos, config.seq_len)
        source = sources_lib.open_source(config.data, text_field=config.text_field, vocab_size=tok.vocab_size)
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"{process_index=} must be in [0, {process_count=}).")
    indices = split_indices(len(source), config.eval_fraction)[split]
    ds = grain.MapDataset.source(indices).map(functools.partial(_document, source))
    if split == "train":
        ds = ds.shuffle(seed=config.seed).repeat(config.num_epochs)
    ds = grain.experimental.FlatMapIterDataset(ds.to_iter_dataset(), _FlatMap(fan_out))
    rows = config.batch_size * process_count
    features = ("tokens", "loss_mask") if chat else ("tokens",)
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={k: config.seq_len for k in features}, num_packing_bins=config.num_packing_bins or 4 * rows,
        seed=config.seed, shuffle_bins=split == "train",
        padding_struct={k: tok.pad_id if k == "tokens" else 0 for k in features})
    ds = ds.map(_rename_packed)
    if split == "train":
        ds = ds.batch(rows, drop_remainder=True)
    else:
        ds = ds.batch(rows, batch_fn=functools.partial(_pad_batch, rows, tok.pad_id))
    if process_count > 1:
        ds = ds.map(functools.partial(_process_rows, process_index * config.batch_size, config.batch_size))
    if config.num_workers:
        # grain's worker processes read absl flags; outside `absl.app.run` (tests, notebooks) nobody
        # has parsed them, so accept the defaults rather than fail on first access.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.num_workers))
    return ds


def make_train_and_eval(config: DataConfig, *, tokenizer=None, process_index: int | None = None,
                        process_count: int | None = None):
    """Returns `(train_ds, eval_ds)`: `make_dataset` for both splits, sharing one tokenizer."""
    tok = tokenizer or tokenizer_lib.load_tokenizer(config.tokenizer)
    kwargs = dict(tokenizer=tok, process_index=process_index, process_count=process_count)
    return make_dataset(config, "train", **kwargs), make_dataset(config, "eval", **kwargs)


def split_indices(num_documents: int, eval_fraction: float) -> dict[str, np.ndarray]:
    """Returns {"train", "eval"} document indices: a fixed hash picks ~eval_fraction for eval.

    Costs 4 bytes per document (uint32 indices below 2**32 documents), computed in chunks.
    """
    if num_documents < 2:
        raise sources_lib.DataError(f"need at least 2 documents for a train/eval split, got "
                                    f"{num_documents}.")
    dtype = np.uint32 if num_documents < 2**32 else np.uint64
    train, evals = [], []
    for start in range(0, num_documents, _SPLIT_CHUNK):
        index = np.arange(start, min(num_documents, start + _SPLIT_CHUNK), dtype=np.uint64)
        is_eval = _uniform_hash(index) < eval_fraction
        train.append(index[~is_eval].astype(dtype))
        evals.append(index[is_eval].astype(dtype))
    train, evals = np.concatenate(train), np.concatenate(evals)
    if not len(evals) or not len(train):  # Tiny corpora: the lowest hash is eval, the highest train.
        u = _uniform_hash(np.arange(num_documents, dtype=np.uint64))
        is_eval = u < eval_fraction
        is_eval[np.argmin(u)], is_eval[np.argmax(u)] = True, False
        train, evals = np.flatnonzero(~is_eval).astype(dtype), np.flatnonzero(is_eval).astype(dtype)
    return {"train": train, "eval": evals}


def _process_rows(start: int, n: int, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A global batch -> this process's consecutive rows [start, start + n)."""
    return {k: v[start:start + n] for k, v in batch.items()}


def _uniform_hash(x: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 `x`, mapped to floats in [0, 1)."""
    with np.errstate(over="ignore"):
        z = x + _SPLIT_SALT + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)


def _document(source, index) -> str | np.ndarray:
    return source[int(index)]


def _document_chunks(tokenizer, add_bos: bool, seq_len: int, document) -> list[dict[str, np.ndarray]]:
    """Document (text or int32 ids) -> [{"tokens": chunk}]: int32 [BOS] + ids + [EOS] in chunks of at
    most seq_len tokens."""
    ids = np.asarray(tokenizer.encode(document) if isinstance(document, str) else document, dtype=np.int32)
    parts = [[tokenizer.bos_id]] if add_bos else []
    ids = np.concatenate(parts + [ids, [tokenizer.eos_id]]).astype(np.int32)
    return [{"tokens": ids[i:i + seq_len]} for i in range(0, len(ids), seq_len)]


class _FlatMap(grain.experimental.FlatMapTransform):
    """One item -> the list `fan_out(item)` returns."""

    max_fan_out = 2**31 - 1  # Documents have no length limit; the iter flat-map never buffers a fan-out.

    def __init__(self, fan_out):
        self.fan_out = fan_out

    def flat_map(self, item) -> list:
        return self.fan_out(item)


def _rename_packed(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {"tokens": row["tokens"].astype(np.int32),
           "segment_ids": row["tokens_segment_ids"].astype(np.int32),
           "positions": row["tokens_positions"].astype(np.int32)}
    if "loss_mask" in row:  # packed beside the tokens, so its segments are theirs
        out["loss_mask"] = row["loss_mask"].astype(np.int32)
    return out


def _pad_batch(batch_size: int, pad_id: int, rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stacks rows and fills a short last batch with all-padding rows (segment id 0)."""
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    missing = batch_size - len(rows)
    if missing:
        fill = {"tokens": pad_id, "segment_ids": 0, "positions": 0, "loss_mask": 0}
        batch = {k: np.concatenate([v, np.full((missing, v.shape[1]), fill[k], np.int32)]) for k, v in batch.items()}
    return batch

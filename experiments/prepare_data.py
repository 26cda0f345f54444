"""Tokenizes text documents into ArrayRecord shards that the training pipeline reads directly.

    python -m experiments.prepare_data --input='corpus/*.jsonl' --output=DIR \
        [--tokenizer=tokenizer.json] [--shard_size=100000] [--text_field=text]

Without --input it prepares the bundled fortune corpus; without --tokenizer it uses the bundled
BPE. Input documents follow `dsv3_jax.data.sources` (.txt: blank-line separated; .jsonl: one
object per line). Each document becomes one record of little-endian int32 ids (no BOS/EOS: the
pipeline adds them), in input order, `shard_size` documents per shard:
`DIR/data-00000-of-00003.arrayrecord`, each with a `.json` sidecar (counts, largest id, the
tokenizer file). Then train with `DataConfig(data="DIR/*.arrayrecord", tokenizer=<same file>)`.
An input that cannot be prepared (an empty file, shards already there): one line, exit code 2.
"""

import json
import math
import os
import pathlib
import sys
import time

import numpy as np
from absl import flags

from dsv3_jax import cli
from dsv3_jax.data import sources
from dsv3_jax.data import tokenizer as tokenizer_lib

_ENCODE_CHUNK = 512  # Documents per encode_batch call (HF tokenizers parallelises inside).


def prepare(input_glob, output_dir, *, tokenizer_path=None, shard_size=100_000,
            text_field="text", progress=sys.stderr) -> list[str]:
    """Writes the shards and their sidecars; returns the shard paths."""
    from array_record.python import array_record_module

    if shard_size < 1:
        raise ValueError(f"{shard_size=} must be >= 1.")
    tok = tokenizer_lib.load_tokenizer(tokenizer_path)
    source = sources.open_source(input_glob, text_field=text_field)
    if not isinstance(source, sources.TextSource):
        raise sources.DataError(f"{input_glob}: already tokenized; prepare_data reads text only.")
    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.arrayrecord")):
        raise FileExistsError(f"{out} already holds .arrayrecord shards; use an empty folder.")

    total = len(source)
    num_shards = math.ceil(total / shard_size)
    paths, done, start, last = [], 0, time.monotonic(), 0.0
    for shard in range(num_shards):
        path = str(out / f"data-{shard:05d}-of-{num_shards:05d}.arrayrecord")
        writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
        meta = {"num_records": 0, "num_tokens": 0, "max_token_id": -1, "max_token_record": -1,
                "tokenizer": tok.path, "vocab_size": tok.vocab_size}
        lo, hi = shard * shard_size, min(total, (shard + 1) * shard_size)
        for chunk in range(lo, hi, _ENCODE_CHUNK):
            texts = [source[i] for i in range(chunk, min(hi, chunk + _ENCODE_CHUNK))]
            for ids in tok.encode_batch(texts):
                ids = np.asarray(ids, dtype=np.int32)
                writer.write(sources.encode_tokens(ids))
                if ids.size and ids.max() > meta["max_token_id"]:
                    meta["max_token_id"], meta["max_token_record"] = int(ids.max()), meta["num_records"]
                meta["num_records"] += 1
                meta["num_tokens"] += int(ids.size)
            done += len(texts)
            if time.monotonic() - last > 1.0:
                last = time.monotonic()
                _report(progress, done, total, start)
        writer.close()
        pathlib.Path(sources.sidecar_path(path)).write_text(json.dumps(meta, indent=1))
        paths.append(path)
    _report(progress, done, total, start, end="\n")
    return paths


def _report(stream, done, total, start, end="\r"):
    if stream is None:
        return
    elapsed = max(time.monotonic() - start, 1e-9)
    rate = done / elapsed
    eta = (total - done) / rate if rate else float("inf")
    stream.write(f"{done}/{total} docs  {rate:,.0f} docs/s  ETA {eta:,.0f}s{' ' * 8}{end}")
    stream.flush()


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("input", None, "glob(s), comma-separated, of .txt/.jsonl files; default: bundled corpus",
                        flag_values=fv)
    flags.DEFINE_string("tokenizer", None, "tokenizer.json or HF folder", flag_values=fv)
    flags.DEFINE_string("output", None, "folder for the shards", required=True, flag_values=fv)
    flags.DEFINE_integer("shard_size", 100_000, "documents per shard", flag_values=fv)
    flags.DEFINE_string("text_field", "text", "document field in .jsonl files", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    try:
        paths = prepare(args.input, args.output, tokenizer_path=args.tokenizer,
                        shard_size=args.shard_size, text_field=args.text_field)
    except (ValueError, OSError) as e:  # DataError is a ValueError
        return cli.fail(e)
    print(f"wrote {len(paths)} shards to {os.path.abspath(args.output)}")
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

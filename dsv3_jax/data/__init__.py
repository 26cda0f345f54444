"""Data for dsv3-jax: the bundled corpus and tokenizer, document sources, grain pipelines.

Batches are dicts of int32 [batch_size, seq_len] arrays `tokens`, `segment_ids`, `positions`, and
for chat data (`chat`, `chat_template`) `loss_mask` (see `pipeline`). Bundled tokenizer ids: pad 0,
bos 1, eos 2; vocab 2048. Bundled chat set: `assets/chat.jsonl` (`make_chat`).
"""

from dsv3_jax.data.corpus import fortune_documents
from dsv3_jax.data.pipeline import DataConfig, make_dataset, make_train_and_eval, split_indices
from dsv3_jax.data.sources import DataError, TextSource, TokenSource, open_source
from dsv3_jax.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DataConfig", "DataError", "TextSource", "TokenSource", "Tokenizer", "fortune_documents", "load_tokenizer",
    "make_dataset", "make_train_and_eval", "open_source", "split_indices",
]

"""Small, unique-document corpora for the data tests (built from the bundled fortunes)."""

import json

import pytest

from dsv3_jax.data import corpus
from dsv3_jax.data import tokenizer as tokenizer_lib


def unique_documents(n: int = 240, num_long: int = 6) -> list[str]:
    """`n` distinct documents; the last `num_long` are ten fortunes long (hundreds of tokens)."""
    fortunes = list(dict.fromkeys(corpus.fortune_documents()))
    docs = [f"Document {i}. {fortunes[i]}" for i in range(n - num_long)]
    for j in range(num_long):
        start = 1000 + 10 * j
        docs.append(f"Long document {j}. " + "\n\n".join(fortunes[start:start + 10]))
    return docs


@pytest.fixture(scope="session")
def tokenizer():
    return tokenizer_lib.load_tokenizer()


@pytest.fixture(scope="session")
def docs():
    return unique_documents()


@pytest.fixture(scope="session")
def jsonl_path(tmp_path_factory, docs):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return str(path)

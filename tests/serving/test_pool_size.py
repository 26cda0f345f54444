"""`experiments.serve`'s default page pool (`pool_tokens`): whole pages the mesh's batch shards
divide, from a device's memory left by the weights, else (CPU) a page-rounded context per slot."""

import types

import jax
import pytest

from dsv3_jax import ModelConfig
from experiments.serve import pool_tokens

LIMIT, IN_USE, FRACTION = 80 << 30, 13 << 30, 0.9  # an 80 GB GPU holding 13 GB of weights
TOKEN_BYTES = (512 + 64) * 2 * 61  # the 671B's bf16 cache: latent + rope key, 61 layers


def _args(**kw):
    return types.SimpleNamespace(**{"max_cache_tokens": None, "page_size": 128, "max_batch": 8, "use_mtp": False,
                                    "cache_dtype": "bfloat16", "cache_memory_fraction": FRACTION, **kw})


def test_without_memory_stats_each_slot_holds_its_longest_request_in_whole_pages():
    tokens, source = pool_tokens(_args(page_size=32, max_batch=4), ModelConfig.tiny(), max_seq_len=100)
    assert jax.devices()[0].memory_stats() is None  # the CPU reports none
    assert tokens == 4 * 4 * 32 and "no memory" in source  # 100 tokens take 4 pages of 32


@pytest.mark.parametrize("shards", [1, 4])
def test_a_device_holds_its_shards_pages_within_the_fraction_left_by_the_weights(monkeypatch, shards):
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": LIMIT, "bytes_in_use": IN_USE})
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    monkeypatch.setattr("dsv3_jax.inference.cache.token_shards", lambda mesh: shards)
    tokens, _ = pool_tokens(_args(), ModelConfig.deepseek_v3(), 4096, mesh=object() if shards > 1 else None)
    assert tokens % (shards * 128) == 0
    per_device = tokens // shards
    assert IN_USE + per_device * TOKEN_BYTES <= FRACTION * LIMIT < IN_USE + (per_device + 128) * TOKEN_BYTES
    assert pool_tokens(_args(max_cache_tokens=4096), ModelConfig.deepseek_v3(), 4096)[0] == 4096

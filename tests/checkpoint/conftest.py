"""Tiny HF folders for the checkpoint tests, made by benchmarks/make_synthetic_checkpoint.py."""

from __future__ import annotations

import os

import pytest

from dsv3_jax.config import ModelConfig
from benchmarks.make_synthetic_checkpoint import make_checkpoint

PARITY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "parity")


def tiny_cfg(**overrides) -> ModelConfig:
    """Hub-like structure at test size: dense + MoE layers, 8 experts, one MTP layer."""
    base = dict(vocab_size=96, num_layers=3, num_dense_layers=1, num_routed_experts=8, num_expert_groups=4,
                num_groups_per_token=2, num_experts_per_token=2, num_mtp_layers=1, compute_dtype="float32")
    return ModelConfig.tiny(**{**base, **overrides})


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    """{"bf16" | "fp32" | "fp8": HF folder} (one shard per layer, MTP copies, FP8 scales)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for tag, dtype, use_fp8 in [("bf16", "bfloat16", False), ("fp32", "float32", False), ("fp8", "bfloat16", True)]:
        out[tag] = str(root / tag)
        make_checkpoint(tiny_cfg(param_dtype=dtype), out[tag], dtype=dtype, use_fp8=use_fp8, seed=1)
    return out


def convert(*argv) -> int:
    from dsv3_jax.convert import main

    return main(["--no-progress", *map(str, argv)])

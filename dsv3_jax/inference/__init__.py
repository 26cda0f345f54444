"""Inference over the latent (MLA) cache: prefill, absorbed decode, sampling, MTP speculative decoding."""

from dsv3_jax.inference.cache import KVCache, StackCache, cache_bytes_per_token, init_cache
from dsv3_jax.inference.generate import GenerateStats, Generation, StepTokens, generate
from dsv3_jax.inference.sampling import SamplingConfig

__all__ = ["GenerateStats", "Generation", "KVCache", "SamplingConfig", "StackCache", "StepTokens",
           "cache_bytes_per_token", "generate", "init_cache"]

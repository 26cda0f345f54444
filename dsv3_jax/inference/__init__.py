"""Inference over the latent (MLA) cache: the loop, chunked prefill, sampling, MTP speculative decoding
and the cache layout; every forward is the model's own (`DeepSeekV3.forward(..., cache=)`)."""

from dsv3_jax.inference.cache import bucket_slots, cache_bytes_per_token, init_cache
from dsv3_jax.inference.generate import GenerateStats, Generation, StepTokens, generate
from dsv3_jax.inference.sampling import SamplingConfig

__all__ = ["GenerateStats", "Generation", "SamplingConfig", "StepTokens", "bucket_slots", "cache_bytes_per_token",
           "generate", "init_cache"]

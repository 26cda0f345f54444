"""Flax NNX modules, one concept a file, assembled bottom-up in `transformer.py`."""

from dsv3_jax.model.attention import LatentCache
from dsv3_jax.model.transformer import DeepSeekV3, ModelCache, ModelOutput

__all__ = ["DeepSeekV3", "LatentCache", "ModelCache", "ModelOutput"]

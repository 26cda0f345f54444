"""Flax NNX modules, one concept a file, assembled bottom-up in `transformer.py`."""

from dsv3_jax.model.transformer import DeepSeekV3, ModelOutput

__all__ = ["DeepSeekV3", "ModelOutput"]

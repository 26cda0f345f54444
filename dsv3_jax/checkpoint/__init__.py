"""HF safetensors <-> this model: name mapping, FP8 dequantisation, `load_pretrained`."""

from dsv3_jax.checkpoint.load import load_pretrained
from dsv3_jax.checkpoint.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "load_pretrained"]

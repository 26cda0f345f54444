"""The latent KV cache of MLA: per layer and token, the normalised latent c (C) and the roped key (R).

Letters: L layers of a stack, B batch, S cache length (slots), C kv_lora_rank, R qk_rope_head_dim,
G = ceil(C / 128) fp8 scale blocks.

Cache dtypes (`cache_dtype`):
  "float32" / "bfloat16": c and k_pe in that dtype, (C + R) * itemsize bytes per token per layer.
  "float8": the FlashMLA layout, c as e4m3 with one fp32 scale per 128 values (DeepSeek's 1x128
    activation recipe) and k_pe in bf16: C + 4 G + 2 R bytes (656 for the 671B preset).

The cache is indexed by absolute position: slot s holds the token at position s. Slots at or past a
row's length hold stale entries that attention never reads (queries see keys at positions <= their
own), so rejected speculative tokens need no rollback.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv3_jax.config import ModelConfig

CACHE_DTYPES = ("float32", "bfloat16", "float8")
FP8_BLOCK = 128


class StackCache(NamedTuple):
    """Cache of one layer stack (dense layers, MoE layers or MTP depths), stacked on L."""

    latent: jax.Array  # [L, B, S, C] float32 | bfloat16 | float8_e4m3fn
    latent_scale: jax.Array | None  # [L, B, S, G] float32 for float8, else None
    k_pe: jax.Array  # [L, B, S, R] float32 | bfloat16 (bfloat16 for float8)


class KVCache(NamedTuple):
    dense: StackCache | None
    moe: StackCache | None
    mtp: StackCache | None


def _check_dtype(cache_dtype: str) -> None:
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_dtype!r}")


def token_layout(cfg: ModelConfig, cache_dtype: str) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """Per-token, per-layer arrays of the cache: name -> (trailing shape, dtype)."""
    _check_dtype(cache_dtype)
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if cache_dtype == "float8":
        return {"latent": ((c,), jnp.dtype(jnp.float8_e4m3fn)),
                "latent_scale": ((math.ceil(c / FP8_BLOCK),), jnp.dtype(jnp.float32)),
                "k_pe": ((r,), jnp.dtype(jnp.bfloat16))}
    dt = jnp.dtype(cache_dtype)
    return {"latent": ((c,), dt), "k_pe": ((r,), dt)}


def cache_bytes_per_token(cfg: ModelConfig, cache_dtype: str = "bfloat16") -> int:
    """Bytes the cache holds per token per layer: 1152 (bf16) and 656 (float8) for the 671B preset."""
    return sum(math.prod(shape) * dt.itemsize for shape, dt in token_layout(cfg, cache_dtype).values())


def _stack(cfg: ModelConfig, cache_dtype: str, layers: int, batch: int, slots: int) -> StackCache | None:
    if layers == 0:
        return None
    arrays = {name: jnp.zeros((layers, batch, slots, *shape), dt)
              for name, (shape, dt) in token_layout(cfg, cache_dtype).items()}
    return StackCache(arrays["latent"], arrays.get("latent_scale"), arrays["k_pe"])


def init_cache(cfg: ModelConfig, batch: int, slots: int, cache_dtype: str = "bfloat16", *,
               with_mtp: bool = False) -> KVCache:
    """A zero cache of `slots` positions for every layer (and the MTP depths when `with_mtp`)."""
    return KVCache(_stack(cfg, cache_dtype, cfg.num_dense_layers, batch, slots),
                   _stack(cfg, cache_dtype, cfg.num_moe_layers, batch, slots),
                   _stack(cfg, cache_dtype, cfg.num_mtp_layers if with_mtp else 0, batch, slots))


def bucket_slots(needed: int) -> int:
    """Cache length for `needed` positions: the next power of two (at least 16), so that one compiled
    decode step serves every prompt + generation length up to it."""
    return max(16, 1 << max(needed - 1, 0).bit_length())


def encode(latent_BxTxC: jax.Array, k_pe_BxTxR: jax.Array, cache_dtype: str):
    """Fresh entries -> (latent, latent_scale | None, k_pe) in the cache's dtypes."""
    if cache_dtype != "float8":
        dt = jnp.dtype(cache_dtype)
        return latent_BxTxC.astype(dt), None, k_pe_BxTxR.astype(dt)
    from pallas_kernels import quantize_1x128  # the DeepSeek 1x128 recipe; kernels import on demand

    b, t, c = latent_BxTxC.shape
    q, scale = quantize_1x128(latent_BxTxC.reshape(b * t, c))
    return q.reshape(b, t, c), scale.reshape(b, t, -1), k_pe_BxTxR.astype(jnp.bfloat16)


def decode_latent(latent_BxSxC: jax.Array, scale_BxSxG: jax.Array | None, dtype) -> jax.Array:
    """Cached latent -> `dtype` values (fp8 entries times their per-128 scale)."""
    if scale_BxSxG is None:
        return latent_BxSxC.astype(dtype)
    c = latent_BxSxC.shape[-1]
    scale = jnp.repeat(scale_BxSxG, FP8_BLOCK, axis=-1)[..., :c]
    return (latent_BxSxC.astype(jnp.float32) * scale).astype(dtype)

"""The latent KV cache of MLA: per layer and token, the normalised latent c (C) and the roped key (R).

Letters: L layers of a stack, B batch, S cache length (slots), C kv_lora_rank, R qk_rope_head_dim,
G = ceil(C / 128) fp8 scale blocks.

Cache dtypes (`cache_dtype`):
  "float32" / "bfloat16": c and k_pe in that dtype, (C + R) * itemsize bytes per token per layer.
  "float8": the FlashMLA layout, c as e4m3 with one fp32 scale per 128 values (DeepSeek's 1x128
    activation recipe) and k_pe in bf16: C + 4 G + 2 R bytes (656 for the 671B preset).
  "int8": c as symmetric int8 with one fp32 scale per token (amax / 127) and k_pe in bf16:
    C + 4 + 2 R bytes (644 for the 671B preset). Per-token scales cost 12 bytes less than fp8's
    per-128 ones, and int8 keeps 8 bits where e4m3 keeps 4 (with an exponent): a token's small
    latent values lose more, its large ones less (tests/inference/test_cache.py bounds both).

V3.2 (the lightning indexer) adds the index key per token and layer (index_head_dim K): float32 /
bfloat16 as they are, float8 (e4m3) / int8 with one fp32 scale per key, as the indexer kernel reads it.

The cache is indexed by absolute position: slot s holds the token at position s. A call's tokens see
the slots before their positions and their own new entries, never a slot past them: stale entries
(rejected speculative tokens, a padded prefill chunk) need no rollback.

The types (`LatentCache`, `ModelCache`) belong to the model, which reads and writes them; this file
fixes their layout: dtypes, sizes and buckets.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dsv3_jax.config import ModelConfig
from dsv3_jax.model.attention import LatentCache
from dsv3_jax.model.transformer import ModelCache
from dsv3_jax.ops.latent_attention import FP8_BLOCK
import sharding
from sharding import expert_parallel

CACHE_DTYPES = ("float32", "bfloat16", "float8", "int8")


def token_layout(cfg: ModelConfig, cache_dtype: str) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """Per-token, per-layer arrays of the cache: name -> (trailing shape, dtype)."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_dtype!r}")
    c, r, bf16, f32 = cfg.kv_lora_rank, cfg.qk_rope_head_dim, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    if cache_dtype == "float8":
        layout = {"latent": ((c,), jnp.dtype(jnp.float8_e4m3fn)), "latent_scale": ((math.ceil(c / FP8_BLOCK),), f32),
                  "k_pe": ((r,), bf16)}
    elif cache_dtype == "int8":
        layout = {"latent": ((c,), jnp.dtype(jnp.int8)), "latent_scale": ((1,), f32), "k_pe": ((r,), bf16)}
    else:
        layout = {"latent": ((c,), jnp.dtype(cache_dtype)), "k_pe": ((r,), jnp.dtype(cache_dtype))}
    if cfg.has_indexer:
        key_dtype = {"float8": jnp.float8_e4m3fn, "int8": jnp.int8}.get(cache_dtype, cache_dtype)
        layout["index_k"] = ((cfg.index_head_dim,), jnp.dtype(key_dtype))
        if cache_dtype in ("float8", "int8"):
            layout["index_k_scale"] = ((1,), f32)
    return layout


def cache_bytes_per_token(cfg: ModelConfig, cache_dtype: str = "bfloat16") -> int:
    """Bytes the cache holds per token per layer: 1152 (bf16), 656 (float8) and 644 (int8) for the
    671B preset; V3.2 adds its index key (128 values: 256 bytes in bf16, 132 in float8 or int8)."""
    return sum(math.prod(shape) * dt.itemsize for shape, dt in token_layout(cfg, cache_dtype).values())


def _stack(cfg: ModelConfig, cache_dtype: str, layers: int, batch: int, slots: int) -> LatentCache | None:
    """One layer stack (dense layers, MoE layers or MTP depths): [L, B, S, ...] per array."""
    if layers == 0:
        return None
    arrays = {name: jnp.zeros((layers, batch, slots, *shape), dt)
              for name, (shape, dt) in token_layout(cfg, cache_dtype).items()}
    return LatentCache(arrays["latent"], arrays.get("latent_scale"), arrays["k_pe"], arrays.get("index_k"),
                       arrays.get("index_k_scale"))


def init_cache(cfg: ModelConfig, batch: int, slots: int, cache_dtype: str = "bfloat16", *,
               with_mtp: bool = False) -> ModelCache:
    """A zero cache of `slots` positions for every layer (and the MTP depths when `with_mtp`). The
    pool of a paged cache is the same arrays, `batch` pages of `slots` tokens each, read through a
    page table the caller sets (`ModelCache.page_table`)."""
    return ModelCache(_stack(cfg, cache_dtype, cfg.num_dense_layers, batch, slots),
                   _stack(cfg, cache_dtype, cfg.num_moe_layers, batch, slots),
                   _stack(cfg, cache_dtype, cfg.num_mtp_layers if with_mtp else 0, batch, slots))


def bucket_slots(needed: int) -> int:
    """Cache length for `needed` positions: the next power of two (at least 16), so that one compiled
    decode step serves every prompt + generation length up to it."""
    return max(16, 1 << max(needed - 1, 0).bit_length())


def token_shards(mesh) -> int:
    """Devices holding different tokens on `mesh` (1 without one): a step's token count must be a
    multiple of it once the MoE layers run expert-parallel."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape.get(a, 1) for a in expert_parallel.TOKEN_AXES)


def cache_sharding(mesh, max_batch: int, rules=None):
    """The cache's placement on `mesh` (None without one): every array [L, B, S, ...] with its slots B
    split as the rules table splits a batch (`batch`: data x fsdp x expert), so each device holds the
    rows of its own requests, whose attention it computes."""
    if mesh is None:
        return None
    shards = token_shards(mesh)
    if max_batch % shards:
        raise ValueError(f"max_batch={max_batch} is not divisible by the {shards} devices the mesh splits a batch "
                         f"over (data x fsdp x expert): the cache's slots are split over them")
    spec = sharding.logical_to_spec((None, "batch"), (1, max_batch), mesh, sharding.get_rules(rules),
                                    name="cache slots")
    return jax.sharding.NamedSharding(mesh, spec if any(spec) else jax.sharding.PartitionSpec())

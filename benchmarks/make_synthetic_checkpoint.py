"""Writes a random HF DeepSeek-V3 folder with the real checkpoint's structure: per-expert names,
one shard per layer plus an index, MTP layer(s) with their embedding/head copies, optionally the
released FP8 format (e4m3 projections + 128x128 `weight_scale_inv`). Memory stays at one layer.

    python -m benchmarks.make_synthetic_checkpoint --out /tmp/syn1g --size-gb 1 [--fp8] [--dtype float32]
"""

from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
from absl import flags

from dsv3_jax import cli
from dsv3_jax.checkpoint import fp8, hf_names
from dsv3_jax.checkpoint.hf_names import leaf_slices
from dsv3_jax.checkpoint.hf_reader import scale_name
from dsv3_jax.checkpoint.safetensors_io import write_safetensors
from dsv3_jax.config import ModelConfig


def bench_config(num_layers: int, **overrides) -> ModelConfig:
    """Many experts and layers, small widths (64 experts of 512 x 256: ~50 MB bf16 per MoE layer)."""
    base = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                num_layers=num_layers, num_dense_layers=1, num_heads=8, q_lora_rank=192, kv_lora_rank=128,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_routed_experts=64,
                num_shared_experts=1, num_experts_per_token=4, num_expert_groups=8, num_groups_per_token=2,
                num_mtp_layers=1, param_dtype="bfloat16", compute_dtype="bfloat16")
    return ModelConfig(**{**base, **overrides})


def layers_for_size(size_bytes: float, dtype: str = "bfloat16", **overrides) -> int:
    one = bench_config(2, **overrides)
    per_layer = (one.param_counts()["total"] - bench_config(1, **overrides).param_counts()["total"])
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    return max(2, round(size_bytes / (per_layer * itemsize)))


def _tensors_by_layer(cfg: ModelConfig):
    """{HF layer (-1 = outside the layers): [(name, shape)]} in table order, MTP copies included."""
    out: dict[int, list] = {}
    for leaf in hf_names.leaves(cfg):
        shape = leaf.hf_shapes()[0]
        for index, names in leaf_slices(leaf):
            layer = leaf.hf_layers[index[0]] if index else -1
            out.setdefault(layer, []).extend((n, shape) for n in names)
    for copy, main in hf_names.mtp_shared_copies(cfg):
        layer = int(copy.split(".")[2])
        out[layer].append((copy, next(s for n, s in out[-1] if n == main)))
    return out


def make_checkpoint(cfg: ModelConfig, folder: str, *, dtype: str = "bfloat16", use_fp8: bool = False,
                    seed: int = 0) -> int:
    """Writes the folder; returns the bytes of tensor data."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    dt = np.dtype(jnp.dtype(dtype))
    groups = _tensors_by_layer(cfg)
    shards = sorted(groups)
    copies = dict(hf_names.mtp_shared_copies(cfg))
    weight_map, total, main = {}, 0, {}  # main: the embedding and head the MTP layers copy
    for i, layer in enumerate(shards):
        tensors = {}
        for name, shape in groups[layer]:
            if name in copies:
                tensors[name] = main[copies[name]]
                continue
            x = _random(rng, name, shape)
            if use_fp8 and fp8.quantizable(name):
                q, s = fp8.quantize(x)
                tensors[name], tensors[scale_name(name)] = q, s
            else:
                tensors[name] = x.astype(np.float32 if name.endswith("e_score_correction_bias") else dt)
            if name in copies.values():
                main[name] = tensors[name]
        shard = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(os.path.join(folder, shard), tensors, metadata={"format": "pt"})
        weight_map.update({n: shard for n in tensors})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    hf = cfg.to_hf_config()
    hf["torch_dtype"] = "bfloat16" if use_fp8 else dtype
    if use_fp8:
        hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    return total


def _random(rng: np.random.Generator, name: str, shape) -> np.ndarray:
    if "norm" in name:
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (0.3 * rng.uniform(-1, 1, shape)).astype(np.float32)
    scale = 1.0 if name.endswith("embed_tokens.weight") else 1.0 / np.sqrt(shape[-1])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("out", None, "the HF folder to write", required=True, flag_values=fv)
    flags.DEFINE_float("size-gb", 1.0, "approximate tensor bytes", flag_values=fv)
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "dtype of the tensors that are not FP8",
                      flag_values=fv)
    flags.DEFINE_boolean("fp8", False, "released FP8 format for the projections", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random seed of the tensors", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    layers = layers_for_size(args.size_gb * 1e9, "float8_e4m3fn" if args.fp8 else args.dtype)
    cfg = bench_config(layers)
    total = make_checkpoint(cfg, args.out, dtype=args.dtype, use_fp8=args.fp8, seed=args.seed)
    print(f"{args.out}: {layers} layers x {cfg.num_routed_experts} experts, {total / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

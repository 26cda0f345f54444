"""Writes an HF folder in the released FP8 format with the released tensor shapes (hidden 7168,
vocab 129280, q/kv LoRA 1536/512, 128 heads, dense width 18432, expert width 2048) but few layers
and experts: 1 dense + 1 MoE layer with --experts routed experts (16: about 5.2 GB). Tensors are
random and written in row blocks, so memory stays at one block (tens of MB) although the embedding
and head are 1.85 GB each.

    python -m benchmarks.make_released_shapes --out /tmp/released [--experts 16]

Used to check that the converter's memory bound holds at the real shapes:
    /usr/bin/time -v python -m dsv3_jax.convert --hf-dir /tmp/released --out /tmp/ckpt [--dtype float32]
"""

from __future__ import annotations

import json
import os
import sys

import ml_dtypes
import numpy as np
from absl import flags

from dsv3_jax import cli
from dsv3_jax.checkpoint import fp8, hf_names
from dsv3_jax.checkpoint.hf_reader import scale_name
from dsv3_jax.checkpoint.orbax_to_hf import hf_config
from dsv3_jax.checkpoint.safetensors_io import ShardWriter
from dsv3_jax.config import ModelConfig

BLOCK_ROWS = 2048  # rows generated at once: 2048 x 7168 fp32 = 59 MB (a multiple of the 128-row scale block)
BF16 = np.dtype(ml_dtypes.bfloat16)


def released_config(experts: int) -> ModelConfig:
    """DeepSeek-V3's shapes with 2 layers (1 dense, 1 MoE) and `experts` routed experts, no MTP."""
    groups = min(8, experts)
    return ModelConfig.deepseek_v3(num_layers=2, num_dense_layers=1, num_routed_experts=experts,
                                   num_expert_groups=groups, num_groups_per_token=min(4, groups),
                                   num_experts_per_token=min(8, experts), num_mtp_layers=0,
                                   param_dtype="bfloat16", compute_dtype="bfloat16")


def _tensors(cfg: ModelConfig) -> dict[int, list[tuple[str, tuple[int, ...]]]]:
    """{HF layer (-1: outside the layers): [(name, shape)]}."""
    out: dict[int, list] = {}
    for leaf in hf_names.leaves(cfg):
        shape = tuple(leaf.hf_shapes()[0])
        for index, names in hf_names.leaf_slices(leaf):
            layer = leaf.hf_layers[index[0]] if index else -1
            out.setdefault(layer, []).extend((n, shape) for n in names)
    return out


def _specs(tensors):
    for name, shape in tensors:
        if fp8.quantizable(name):
            yield name, fp8.E4M3, shape
            yield scale_name(name), np.dtype(np.float32), fp8.scale_shape(shape)
        elif name.endswith("e_score_correction_bias"):
            yield name, np.dtype(np.float32), shape
        else:
            yield name, BF16, shape


class BlockWriter(ShardWriter):
    """A `ShardWriter` that also takes a tensor as consecutive row blocks: memory stays at one
    block of a 129280 x 7168 embedding or a 18432 x 7168 projection."""

    def write_blocks(self, name: str, dtype, shape: tuple[int, ...], blocks) -> None:
        want, rows = self._next(name, dtype, shape), 0
        for block in blocks:
            if block.dtype != want[1] or tuple(block.shape[1:]) != tuple(shape[1:]):
                raise ValueError(f"{self.path}: block of {name} is {block.dtype} {block.shape}")
            self._f.write(np.ascontiguousarray(block).tobytes())
            rows += block.shape[0]
        if rows != shape[0]:
            raise ValueError(f"{self.path}: {name} got {rows} rows, the header says {shape[0]}")


def _write_tensor(writer: BlockWriter, rng, name: str, shape: tuple[int, ...]) -> None:
    rows = shape[0]
    if len(shape) == 1:
        x = (1.0 + 0.1 * rng.standard_normal(shape)) if "norm" in name else 0.3 * rng.uniform(-1, 1, shape)
        writer.write(name, x.astype(np.float32 if name.endswith("bias") else BF16))
        return
    scale = np.float32(1.0 if name.endswith("embed_tokens.weight") else 1.0 / np.sqrt(shape[1]))

    def blocks():
        for r0 in range(0, rows, BLOCK_ROWS):
            yield rng.standard_normal((min(rows, r0 + BLOCK_ROWS) - r0, shape[1]), dtype=np.float32) * scale

    if not fp8.quantizable(name):
        writer.write_blocks(name, BF16, shape, (b.astype(BF16) for b in blocks()))
        return
    scales = []

    def quantized():
        for b in blocks():
            q, s = fp8.quantize(b)
            scales.append(s)
            yield q

    writer.write_blocks(name, fp8.E4M3, shape, quantized())
    writer.write(scale_name(name), np.concatenate(scales))


def make_released(folder: str, experts: int = 16, seed: int = 0) -> int:
    """Writes the folder; returns its bytes."""
    cfg = released_config(experts)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    groups = _tensors(cfg)
    weight_map, total = {}, 0
    for i, layer in enumerate(sorted(groups)):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        specs = list(_specs(groups[layer]))
        writer = BlockWriter(os.path.join(folder, shard), specs, metadata={"format": "pt"})
        try:
            for name, shape in groups[layer]:
                _write_tensor(writer, rng, name, shape)
        finally:
            writer.close()
        weight_map.update({name: shard for name, _, _ in specs})
        total += writer.nbytes
        print(f"{shard}: {writer.nbytes / 1e9:.2f} GB", flush=True)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(cfg, BF16, fp8_out=True), f, indent=1)
    return total


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("out", None, "the HF folder to write", required=True, flag_values=fv)
    flags.DEFINE_integer("experts", 16, "routed experts of the MoE layer", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random seed of the tensors", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    total = make_released(args.out, args.experts, args.seed)
    print(f"{args.out}: 1 dense + 1 MoE layer x {args.experts} experts at the released shapes, {total / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

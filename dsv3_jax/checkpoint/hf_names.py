"""The one table between HF DeepSeek-V3 tensor names and this model's parameter paths.

Each `Leaf` says which HF tensors make one slice of one of our parameters, and how their dims
become that slice's (`Layout`: read by `hf_reader.read_shard`, inverted by `slice_to_hf`).
Stacked parameters ([layers, ...]) have one slice per HF layer; MoE expert weights gather E
per-expert HF tensors into one [E, ...] parameter, one slice per expert.

HF linear weights are [out, in]; ours are [in, out] with the heads axis split out where it helps
(wq_b [Q, H, K], wkv_b [C, H, N+V], wo [H, V, D]). The rope rows need no permutation: our rope
rotates the same adjacent pairs HF's interleaved rope does.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import numpy as np

from dsv3_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: tuple[str, ...]  # our parameter path, e.g. ("moe_layers", "attn", "wq_a")
    hf: Callable[[int | None], list[str]]  # HF names of one slice, given the HF layer index
    hf_layers: tuple[int, ...] | None  # HF layer of each stacked slice; None: not stacked
    hf_shapes: Callable[[], list[tuple[int, ...]]]  # expected HF shapes of one slice
    layout: "Layout"  # how one HF tensor's dims become ours, both ways (`read_shard`, `slice_to_hf`)

    def hf_name(self, stack: tuple[int, ...]) -> str:
        """The HF tensor of stack element `stack` ((), (layer,) or (layer, expert) in our stacked dims)."""
        names = self.hf(self.hf_layers[stack[0]] if stack else None)
        return names[stack[1] if len(stack) == 2 else 0]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Our slice = HF tensor (transposed if `transposed`), each of its dims split into `split[i]`
    consecutive dims of ours (row-major). E.g. q_b_proj [H*K, Q] -> ours [Q, H, K]: transposed,
    split (1, 2). Experts: each HF [F, D] is one [D, F] slice of ours [E, D, F]."""

    transposed: bool
    split: tuple[int, ...]


def _t(shape_ours: tuple[int, ...]):
    """HF [out, in] <-> ours [in, *split(out)] for a matrix whose out dim splits into `shape_ours[1:]`."""
    return lambda: [(int(np.prod(shape_ours[1:])), shape_ours[0])], Layout(True, (1, len(shape_ours) - 1))


def _wo(h: int, v: int, d: int):
    return lambda: [(d, h * v)], Layout(True, (2, 1))


def _same(shape: tuple[int, ...]):
    return lambda: [shape], Layout(False, (1,) * len(shape))


def _experts(e: int, shape_ours: tuple[int, int]):
    """E HF [out, in] matrices <-> ours [E, in, out]."""
    return lambda: [(shape_ours[1], shape_ours[0])] * e, Layout(True, (1, 1))


def _one(name: str) -> Callable[[int], list[str]]:
    """The HF name of a per-layer tensor `model.layers.L.<name>`, given L."""
    return lambda layer: [f"model.layers.{layer}.{name}"]


def _block_leaves(cfg: ModelConfig, moe: bool) -> Iterator[tuple[tuple[str, ...], Callable, tuple]]:
    """(our sub-path, HF suffix names for layer L, converters) for one transformer block."""
    d, h, c, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    k, nv = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    yield ("attn_norm", "weight"), _one("input_layernorm.weight"), _same((d,))
    yield ("ffn_norm", "weight"), _one("post_attention_layernorm.weight"), _same((d,))
    if cfg.q_lora_rank is None:
        yield ("attn", "wq"), _one("self_attn.q_proj.weight"), _t((d, h, k))
    else:
        q = cfg.q_lora_rank
        yield ("attn", "wq_a"), _one("self_attn.q_a_proj.weight"), _t((d, q))
        yield ("attn", "q_norm", "weight"), _one("self_attn.q_a_layernorm.weight"), _same((q,))
        yield ("attn", "wq_b"), _one("self_attn.q_b_proj.weight"), _t((q, h, k))
    yield ("attn", "wkv_a"), _one("self_attn.kv_a_proj_with_mqa.weight"), _t((d, c + r))
    yield ("attn", "kv_norm", "weight"), _one("self_attn.kv_a_layernorm.weight"), _same((c,))
    yield ("attn", "wkv_b"), _one("self_attn.kv_b_proj.weight"), _t((c, h, nv))
    yield ("attn", "wo"), _one("self_attn.o_proj.weight"), _wo(h, cfg.v_head_dim, d)
    if cfg.has_indexer:  # V3.2's lightning indexer
        n, ki = cfg.index_n_heads, cfg.index_head_dim
        yield ("attn", "indexer", "wq_b"), _one("self_attn.indexer.wq_b.weight"), _t((cfg.q_lora_rank, n, ki))
        yield ("attn", "indexer", "wk"), _one("self_attn.indexer.wk.weight"), _t((d, ki))
        yield ("attn", "indexer", "k_norm", "weight"), _one("self_attn.indexer.k_norm.weight"), _same((ki,))
        yield ("attn", "indexer", "k_norm", "bias"), _one("self_attn.indexer.k_norm.bias"), _same((ki,))
        yield ("attn", "indexer", "weights_proj"), _one("self_attn.indexer.weights_proj.weight"), _t((d, n))
    if not moe:
        i = cfg.intermediate_size
        yield ("ffn", "w1"), _one("mlp.gate_proj.weight"), _t((d, i))
        yield ("ffn", "w3"), _one("mlp.up_proj.weight"), _t((d, i))
        yield ("ffn", "w2"), _one("mlp.down_proj.weight"), _t((i, d))
        return
    e, f = cfg.num_routed_experts, cfg.moe_intermediate_size
    yield ("ffn", "gate", "weight"), _one("mlp.gate.weight"), _same((e, d))
    yield ("ffn", "gate", "bias"), _one("mlp.gate.e_score_correction_bias"), _same((e,))

    def experts(proj):
        return lambda layer: [f"model.layers.{layer}.mlp.experts.{j}.{proj}.weight" for j in range(e)]

    yield ("ffn", "w1"), experts("gate_proj"), _experts(e, (d, f))
    yield ("ffn", "w3"), experts("up_proj"), _experts(e, (d, f))
    yield ("ffn", "w2"), experts("down_proj"), _experts(e, (f, d))
    if cfg.num_shared_experts:
        fs = f * cfg.num_shared_experts
        yield ("ffn", "shared_experts", "w1"), _one("mlp.shared_experts.gate_proj.weight"), _t((d, fs))
        yield ("ffn", "shared_experts", "w3"), _one("mlp.shared_experts.up_proj.weight"), _t((d, fs))
        yield ("ffn", "shared_experts", "w2"), _one("mlp.shared_experts.down_proj.weight"), _t((fs, d))


def _mtp_leaves(cfg: ModelConfig):
    d = cfg.hidden_size
    yield ("enorm", "weight"), _one("enorm.weight"), _same((d,))
    yield ("hnorm", "weight"), _one("hnorm.weight"), _same((d,))
    yield ("eh_proj",), _one("eh_proj.weight"), _t((2 * d, d))
    yield ("norm", "weight"), _one("shared_head.norm.weight"), _same((d,))
    for sub, names, conv in _block_leaves(cfg, moe=True):
        yield ("block",) + sub, names, conv


def leaves(cfg: ModelConfig) -> list[Leaf]:
    """Every parameter of `DeepSeekV3(cfg)` with its HF source."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [
        Leaf(("embed",), lambda _: ["model.embed_tokens.weight"], None, *_same((v, d))),
        Leaf(("norm", "weight"), lambda _: ["model.norm.weight"], None, *_same((d,))),
        Leaf(("head",), lambda _: ["lm_head.weight"], None, *_t((d, v))),
    ]
    stacks = [
        ("dense_layers", tuple(range(cfg.num_dense_layers)), _block_leaves(cfg, moe=False)),
        ("moe_layers", tuple(range(cfg.num_dense_layers, cfg.num_layers)), _block_leaves(cfg, moe=True)),
        ("mtp", tuple(range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers)), _mtp_leaves(cfg)),
    ]
    for stack, hf_layers, block in stacks:
        if not hf_layers:
            continue
        for sub, names, conv in block:
            out.append(Leaf((stack,) + sub, names, hf_layers, *conv))
    return out


def stacked_dims(leaf: Leaf) -> int:
    """Leading dims of ours that index HF tensors: 0 unstacked, 1 [layer], 2 [layer, expert]."""
    if leaf.hf_layers is None:
        return 0
    return 2 if len(leaf.hf_shapes()) > 1 else 1


def leaf_slices(leaf: Leaf) -> list[tuple[tuple[int, ...], list[str]]]:
    """(our index, HF names) per slice: () unstacked, (layer,) stacked, (layer, expert) for experts."""
    if leaf.hf_layers is None:
        return [((), leaf.hf(None))]
    out = []
    for i, layer in enumerate(leaf.hf_layers):
        names = leaf.hf(layer)
        if stacked_dims(leaf) == 2:  # routed experts: one slice per expert
            out.extend(((i, j), [n]) for j, n in enumerate(names))
        else:
            out.append(((i,), names))
    return out


def slice_to_hf(leaf: Leaf, x: np.ndarray) -> np.ndarray:
    """The HF tensor of one slice of ours (`x`: ours[index] for an index of `leaf_slices`): each
    group of `layout.split` dims merged, then transposed back."""
    dims, d = [], 0
    for n in leaf.layout.split:
        dims.append(int(np.prod(x.shape[d:d + n])))
        d += n
    x = x.reshape(dims)
    return x.T if leaf.layout.transposed else x


def mtp_shared_copies(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(HF MTP-layer copy, main tensor) pairs: each MTP layer stores the embedding and head again."""
    pairs = []
    for layer in range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers):
        pairs.append((f"model.layers.{layer}.embed_tokens.weight", "model.embed_tokens.weight"))
        pairs.append((f"model.layers.{layer}.shared_head.head.weight", "lm_head.weight"))
    return pairs

"""HF transformers' DeepseekV3ForCausalLM as the independent reference (needs torch + transformers).

Weights are re-initialised at a scale that makes logits O(1) and routing choices depend on the
input (HF's default init gives near-zero logits and near-uniform routing, which would prove little),
and router biases are random so that selection and gating differ.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

from dsv3_jax.config import ModelConfig


def build_hf_model(cfg: ModelConfig, seed: int = 0):
    """DeepseekV3ForCausalLM, or DeepseekV32ForCausalLM for a config with the lightning indexer."""
    v32 = cfg.has_indexer
    hf_cfg = (transformers.DeepseekV32Config if v32 else transformers.DeepseekV3Config)(**cfg.to_hf_config())
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = (transformers.DeepseekV32ForCausalLM if v32 else transformers.DeepseekV3ForCausalLM)(hf_cfg).float().eval()
    _reinit(model, torch.Generator().manual_seed(seed))
    return model


def _reinit(model, gen) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("experts.gate_up_proj"):  # [E, 2F, D]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif name.endswith("experts.down_proj"):  # [E, D, F]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:  # [out, in] linears and the router
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * (2 * torch.rand(b.shape, generator=gen) - 1))


def build_hf_mtp(main_model, seed: int = 1):
    """HF's own multi-token-prediction module (transformers.modeling_layers.MtpModel) for `main_model`."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(main_model, main_model.config.num_mtp_layers).float().eval()
    own = {n: p for n, p in mtp.named_parameters() if n.startswith("layers.")}
    gen = torch.Generator().manual_seed(seed)

    class _Only(torch.nn.Module):  # re-initialise the MTP layers only; embedding and head stay shared
        def __init__(self):
            super().__init__()
            self.layers = mtp.layers

    _reinit(_Only(), gen)
    assert own
    return mtp


def hf_mtp_logits(main_model, mtp, tokens: np.ndarray) -> list[np.ndarray]:
    """Depth k (1-based) logits at positions i < T - k, from h^{k-1}_i and token t_{i+k}."""
    ids = torch.from_numpy(np.asarray(tokens, np.int64))
    t = ids.shape[1]
    out = []
    with torch.no_grad():
        h = main_model.model(ids).last_hidden_state
        for k in range(1, len(mtp.layers) + 1):
            pos = torch.arange(t - k)[None].expand(ids.shape[0], -1)
            h = mtp.forward_layer(k - 1, h[:, : t - k], pos, None, input_ids=ids[:, k:])
            out.append(mtp.shared_head(h).float().numpy())
    return out


def mtp_hub_tensors(mtp, num_layers: int) -> dict[str, np.ndarray]:
    """MtpModel weights under the hub's names: MTP depth k is `model.layers.{num_layers + k}`,
    experts split per expert, the final norm as `shared_head.norm`."""
    out = {}
    for name, p in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue
        _, k, rest = name.split(".", 2)
        prefix = f"model.layers.{num_layers + int(k)}."
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        value = p.float().numpy()
        if rest.endswith("mlp.experts.gate_up_proj"):
            f = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = value[e, :f]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = value[e, f:]
        elif rest.endswith("mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[prefix + rest] = value
    return out


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.float().numpy()


def save_hf(model, folder: str, shard_bytes: int | None = None) -> None:
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(folder, **kwargs)


def save_hf_with_mtp(main_model, mtp, folder: str) -> None:
    """`save_pretrained` of the main model plus the MTP layers as the hub stores them (layer
    `num_hidden_layers + k`), in a second shard listed by `model.safetensors.index.json`."""
    import json
    import os

    from dsv3_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors

    main_model.save_pretrained(folder)
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "model-main.safetensors"))
    extra = mtp_hub_tensors(mtp, main_model.config.num_hidden_layers)
    write_safetensors(os.path.join(folder, "model-mtp.safetensors"), extra)
    weight_map = {k: "model-main.safetensors"
                  for k in SafetensorsFile(os.path.join(folder, "model-main.safetensors")).keys()}
    weight_map.update({k: "model-mtp.safetensors" for k in extra})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)

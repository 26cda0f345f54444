"""ModelConfig: every DeepSeek-V3 architecture field, presets, validation, HF config.json I/O.

The config is data: one frozen dataclass, variants are named constructors, features are explicit
fields. It is validated once at construction and every error names the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

_DTYPES = ("float32", "bfloat16", "float16")
# The values each choice field may take.
_CHOICES = {
    "param_dtype": _DTYPES, "compute_dtype": _DTYPES, "moe_impl": ("auto", "ragged", "tiled", "padded", "dense"),
    "expert_exchange": ("auto", "ragged", "padded"), "attention_impl": ("xla", "pallas"),
    "head_loss_impl": ("chunked", "full"), "pipeline_schedule": ("gpipe", "circular", "1f1b", "dualpipev"),
    "scale_fmt": (None, "ue8m0"),
}
INDEXER_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


class ConfigError(ValueError):
    """A config field has a value the model cannot be built with."""


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN context extension (DeepSeek-V3 ships factor 40 over a 4096 original context)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # scale on cos/sin; derived from mscale* when None
    truncate: bool = True

    def __post_init__(self):
        if self.factor <= 0:
            raise ConfigError(f"yarn.factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(f"yarn.original_max_position_embeddings must be > 0, got "
                              f"{self.original_max_position_embeddings}")
        if self.beta_fast <= self.beta_slow:
            raise ConfigError(f"yarn.beta_fast ({self.beta_fast}) must exceed yarn.beta_slow ({self.beta_slow})")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 architecture plus the dtype and implementation policy.

    Defaults are the 671B release; `tiny()` is the test-sized variant.
    """

    # Sizes.
    vocab_size: int = 129280
    hidden_size: int = 7168  # D
    intermediate_size: int = 18432  # dense-layer SwiGLU hidden size
    moe_intermediate_size: int = 2048  # F, per routed/shared expert
    num_layers: int = 61
    num_dense_layers: int = 3  # the first layers use a dense MLP instead of MoE
    # Multi-head latent attention.
    num_heads: int = 128  # H
    q_lora_rank: int | None = 1536  # None: a single q projection (HF `q_proj`)
    kv_lora_rank: int = 512  # C, the cached latent
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # R, one roped key head shared by all heads
    v_head_dim: int = 128
    # DeepSeekMoE.
    num_routed_experts: int = 256  # E
    num_shared_experts: int = 1
    num_experts_per_token: int = 8  # top-k
    num_expert_groups: int = 8
    num_groups_per_token: int = 4  # groups kept before top-k (HF `topk_group`)
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    # Norms and positions.
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # rotate adjacent pairs (DeepSeek layout); False: rotate_half
    max_position_embeddings: int = 163840
    yarn: YarnConfig | None = YarnConfig(
        factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    )
    # Multi-token prediction.
    num_mtp_layers: int = 1
    # DeepSeek Sparse Attention's lightning indexer (V3.2): heads, head dim and the keys each query
    # keeps (DeepSeek Sparse Attention). All 0: no indexer, dense MLA (V3, V3.1).
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # FP8 block scales (HF `quantization_config.scale_fmt`): None, any fp32 scale (V3); "ue8m0", powers
    # of two (V3.1, V3.2), for the stored weights and the activations quantised against them.
    scale_fmt: str | None = None
    # Initialisation and numerics policy.
    initializer_range: float = 0.006
    param_dtype: str = "float32"  # master weights
    compute_dtype: str = "bfloat16"  # matmuls; router, softmax and norms always run in fp32
    # Implementation switches (each fast path has a reference twin held equal by tests).
    moe_impl: str = "auto"  # auto: ragged_dot on TPU/GPU, padded groups or tiled on CPU (ops/dispatch.py; the lowering's platform)
    moe_tile_size: int = 128  # upper bound of the row tile of the tiled grouped matmul
    attention_impl: str = "xla"  # pallas: the flash MLA prefill kernel (pallas_kernels.mla_prefill)
    # The training loss's head: chunked applies it fused with the cross-entropy a chunk of tokens at
    # a time (ops/head_loss.py; never the whole [B, T, V] logits); full: the logits, then the loss.
    head_loss_impl: str = "chunked"
    fp8_matmul: bool = False  # MLA, MLP and expert projections through the FP8 block-scaled kernels
    # Expert parallelism (mesh expert > 1; sharding/expert_parallel.py). None: dropless, each
    # device's receive buffer holds the worst case (P x its own rows); cf: buffers of cf x the
    # rows, (token, expert) pairs past them dropped and counted (metrics `dropped_fraction`).
    expert_capacity_factor: float | None = None
    expert_exchange: str = "auto"  # auto: ragged_all_to_all on TPU/GPU, padded all_to_all on CPU
    remat: bool = False  # rematerialise each layer in the backward pass
    unroll_max_layers: int = 0  # a layer stack this short runs unrolled, no scan loop (host.tune_model on CPU)
    # Microbatches of the pipeline schedule when the mesh has pipeline > 1 (0: the fewest that keep
    # the bubble (S - 1) / (M + S - 1) <= 0.2, as far as the batch divides; sharding/pipeline.py).
    pipeline_microbatches: int = 0
    # Layer chunks per stage: 1 = GPipe; R > 1 = circular schedule (stage s runs chunks s, S + s, ...;
    # bubble (S - 1) / (R * M + S - 1); needs M >= S microbatches).
    pipeline_repeats: int = 1
    # How microbatches move through the stages (sharding/pipeline.py): gpipe (all forwards, then all
    # backwards), circular (needs pipeline_repeats >= 2; pipeline_repeats > 1 with gpipe means it),
    # 1f1b (backward by hand, at most S microbatches in flight), dualpipev (V placement, split backward).
    pipeline_schedule: str = "gpipe"
    # Microbatches the layers outside the pipelined stack (embedding, dense layers, final norm, head,
    # MTP, loss) run in, one after another, each recomputed in the backward, so no device holds its
    # whole batch's logits (0: on a pipeline mesh one row per device at a time, else the whole batch).
    outer_microbatches: int = 0

    def __post_init__(self):
        if self.pipeline_schedule == "gpipe" and isinstance(self.pipeline_repeats, int) and self.pipeline_repeats > 1:
            object.__setattr__(self, "pipeline_schedule", "circular")  # the older spelling of circular
        self._validate()

    # ------------------------------------------------------------------ presets
    @classmethod
    def deepseek_v3(cls, **overrides) -> "ModelConfig":
        """The released DeepSeek-V3 (671B) architecture."""
        return cls().replace(**overrides)

    @classmethod
    def deepseek_v3_1(cls, **overrides) -> "ModelConfig":
        """DeepSeek-V3.1: V3's architecture, its FP8 weights with power-of-two (UE8M0) block scales."""
        return cls(scale_fmt="ue8m0").replace(**overrides)

    @classmethod
    def deepseek_v3_2(cls, **overrides) -> "ModelConfig":
        """DeepSeek-V3.2: V3.1 plus the lightning indexer (64 heads of 128, top 2048 keys per query)."""
        return cls.deepseek_v3_1(index_n_heads=64, index_head_dim=128, index_topk=2048).replace(**overrides)

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A few-MB model with every feature switched on: q LoRA, groups, YaRN, 1 dense layer, MTP."""
        base = cls(
            vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_layers=3, num_dense_layers=1, num_heads=4,
            q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            num_routed_experts=16, num_shared_experts=1, num_experts_per_token=4, num_expert_groups=4,
            num_groups_per_token=2, max_position_embeddings=1024,
            yarn=YarnConfig(factor=4.0, original_max_position_embeddings=256, mscale=1.0, mscale_all_dim=1.0),
            num_mtp_layers=1, initializer_range=0.02, compute_dtype="float32",
        )
        return base.replace(**overrides)

    def replace(self, **overrides) -> "ModelConfig":
        valid = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(valid))
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s) {unknown}; valid fields: {valid}")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Inverse of `to_dict`; unknown keys are an error that lists the valid ones."""
        d = dict(d)
        if d.get("moe_impl") == "capacity":  # the padded groups' name in runs saved before the rename
            d["moe_impl"] = "padded"
        if isinstance(d.get("yarn"), Mapping):
            d["yarn"] = YarnConfig(**d["yarn"])
        return cls().replace(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -------------------------------------------------------------- validation
    def _validate(self):
        lowest = dict.fromkeys((
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_layers",
            "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "num_routed_experts", "num_experts_per_token", "num_expert_groups", "num_groups_per_token",
            "max_position_embeddings", "moe_tile_size", "pipeline_repeats"), 1)
        lowest |= dict.fromkeys(("num_dense_layers", "num_shared_experts", "num_mtp_layers", "pipeline_microbatches",
                                 "outer_microbatches", *INDEXER_FIELDS), 0)
        for name, low in lowest.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ConfigError(f"q_lora_rank must be a positive int or None, got {self.q_lora_rank!r}")
        if self.num_dense_layers > self.num_layers:
            raise ConfigError(f"num_dense_layers ({self.num_dense_layers}) exceeds num_layers ({self.num_layers})")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even (pairs are rotated), got {self.qk_rope_head_dim}")
        if self.num_routed_experts % self.num_expert_groups:
            raise ConfigError(f"num_routed_experts ({self.num_routed_experts}) is not divisible into "
                              f"num_expert_groups ({self.num_expert_groups})")
        if self.experts_per_group < 2:
            raise ConfigError(f"each expert group needs at least 2 experts (groups are scored by their top-2), got "
                              f"num_routed_experts={self.num_routed_experts} / "
                              f"num_expert_groups={self.num_expert_groups}")
        if self.num_groups_per_token > self.num_expert_groups:
            raise ConfigError(f"num_groups_per_token ({self.num_groups_per_token}) exceeds "
                              f"num_expert_groups ({self.num_expert_groups})")
        if self.num_experts_per_token > self.num_groups_per_token * self.experts_per_group:
            raise ConfigError(f"num_experts_per_token ({self.num_experts_per_token}) is larger than the kept groups "
                              f"hold: num_groups_per_token ({self.num_groups_per_token}) x experts_per_group "
                              f"({self.experts_per_group})")
        for name, low in (("routed_scaling_factor", 0), ("rms_norm_eps", 0), ("rope_theta", 1)):
            if getattr(self, name) <= low:
                raise ConfigError(f"{name} must be > {low}, got {getattr(self, name)}")
        if self.yarn is not None and not isinstance(self.yarn, YarnConfig):
            raise ConfigError(f"yarn must be a YarnConfig or None, got {type(self.yarn).__name__}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        self._validate_indexer()
        cf = self.expert_capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ConfigError(f"expert_capacity_factor must be None (dropless) or a number > 0, got {cf!r}")
        if (self.pipeline_schedule == "circular") != (self.pipeline_repeats > 1):
            raise ConfigError(f"pipeline_schedule={self.pipeline_schedule!r} takes "
                              + ("pipeline_repeats >= 2" if self.pipeline_schedule == "circular" else "pipeline_repeats=1")
                              + f", got pipeline_repeats={self.pipeline_repeats}")

    def _validate_indexer(self):
        values = {name: getattr(self, name) for name in INDEXER_FIELDS}
        if not any(values.values()):
            return
        if not all(values.values()):
            raise ConfigError(f"the lightning indexer needs all of {INDEXER_FIELDS} > 0 (or all 0: none), got {values}")
        if self.q_lora_rank is None:
            raise ConfigError("the lightning indexer projects the query LoRA latent: index_n_heads > 0 needs q_lora_rank")
        if self.index_head_dim <= self.qk_rope_head_dim:
            raise ConfigError(f"index_head_dim ({self.index_head_dim}) must exceed qk_rope_head_dim "
                              f"({self.qk_rope_head_dim}): the indexer ropes that many of its dims")

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads > 0

    # ---------------------------------------------------------- derived sizes
    @property
    def experts_per_group(self) -> int:
        return self.num_routed_experts // self.num_expert_groups

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times m^2 with m = 0.1 * mscale_all_dim * ln(factor) + 1 under YaRN."""
        scale = self.qk_head_dim**-0.5
        if self.yarn is not None and self.yarn.mscale_all_dim and self.yarn.factor > 1:
            m = 0.1 * self.yarn.mscale_all_dim * math.log(self.yarn.factor) + 1.0
            scale *= m * m
        return scale

    # ------------------------------------------------------- parameter counts
    def attention_weights(self) -> int:
        """Matmul weights of one MLA layer: q (through the q LoRA when set), kv down and up, output."""
        d, h = self.hidden_size, self.num_heads
        q = d * h * self.qk_head_dim if self.q_lora_rank is None else self.q_lora_rank * (d + h * self.qk_head_dim)
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    def moe_weights(self, routed_experts: int) -> int:
        """Matmul weights of one MoE layer: the router, `routed_experts` routed and the shared experts."""
        d, f = self.hidden_size, self.moe_intermediate_size
        return self.num_routed_experts * d + (routed_experts + self.num_shared_experts) * 3 * d * f

    def indexer_params(self) -> int:
        """One layer's lightning indexer: wq_b on the query latent, wk, k_norm (LayerNorm: gain and
        bias) and weights_proj (one weight per head); 0 without an indexer."""
        n, k, d = self.index_n_heads, self.index_head_dim, self.hidden_size
        return (self.q_lora_rank or 0) * n * k + d * k + 2 * k + d * n

    def _layer_params(self, moe: bool, activated: bool = False) -> int:
        """Matmul weights, norm gains (attention, ffn, q and kv latents), the router's correction bias
        and the indexer."""
        experts = self.num_experts_per_token if activated else self.num_routed_experts
        ffn = self.moe_weights(experts) + self.num_routed_experts if moe else 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + (self.q_lora_rank or 0) + self.kv_lora_rank
        return self.attention_weights() + ffn + norms + self.indexer_params()

    def param_counts(self) -> dict[str, int]:
        """Parameter counts from the config alone.

        total: the main model (embedding, layers, final norm, head); activated: what one token
        touches (top-k routed + shared experts, every router); mtp: the MTP modules' own weights
        (their embedding and output head are the main model's).
        """
        d, v = self.hidden_size, self.vocab_size
        outer = 2 * v * d + d
        dense = self.num_dense_layers * self._layer_params(moe=False)
        total = outer + dense + self.num_moe_layers * self._layer_params(moe=True)
        activated = outer + dense + self.num_moe_layers * self._layer_params(moe=True, activated=True)
        mtp_one = 2 * d + 2 * d * d + self._layer_params(moe=True) + d  # enorm, hnorm, eh_proj, block, norm
        return {"total": total, "activated": activated, "mtp": self.num_mtp_layers * mtp_one}

    # ------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], **overrides) -> "ModelConfig":
        """Reads an HF DeepSeek-V3 `config.json` (a path, its folder, or the parsed dict).

        Accepts the released `rope_scaling` and the transformers-5 `rope_parameters` spellings, V3.2's
        indexer keys and `quantization_config.scale_fmt` (V3.1). Unknown keys are ignored (HF configs
        carry many); unsupported architecture values raise.
        """
        source = "config dict"
        if isinstance(path_or_dict, Mapping):
            hf = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            source = path
            try:
                with open(path) as f:
                    hf = json.load(f)
            except FileNotFoundError:
                raise ConfigError(f"no HF config at {path}") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls(**_hf_to_fields(hf, source), **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict HF transformers loads as `DeepseekV3ForCausalLM`."""
        rope: dict[str, Any] = {"rope_type": "default" if self.yarn is None else "yarn", "rope_theta": self.rope_theta}
        if self.yarn is not None:
            rope |= {k: v for k, v in dataclasses.asdict(self.yarn).items() if k != "attention_factor"}
            if self.yarn.attention_factor is not None:  # written last, and only when set
                rope["attention_factor"] = self.yarn.attention_factor
        fixed = {**_HF_FIXED, "rope_parameters": rope}
        out = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"} if self.has_indexer else {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        out |= {key: fixed[key] if field is None else getattr(self, field) for key, field in _HF_FIELDS.items()}
        if self.has_indexer:
            out |= {name: getattr(self, name) for name in INDEXER_FIELDS}
        out["torch_dtype"] = "bfloat16" if self.param_dtype == "bfloat16" else "float32"
        return out

    def hf_quantization_config(self) -> dict[str, Any]:
        """config.json's `quantization_config` for a folder of FP8 weights (e4m3, 128x128 block scales)."""
        out = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
        if self.scale_fmt is not None:
            out["scale_fmt"] = self.scale_fmt
        return out


# config.json key -> ModelConfig field (None: a value DeepSeek-V3 fixes), in the order `to_hf_config` writes them.
_HF_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "moe_intermediate_size": "moe_intermediate_size", "num_hidden_layers": "num_layers",
    "first_k_dense_replace": "num_dense_layers", "num_attention_heads": "num_heads", "num_key_value_heads": "num_heads",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "n_routed_experts": "num_routed_experts",
    "n_shared_experts": "num_shared_experts", "num_experts_per_tok": "num_experts_per_token",
    "n_group": "num_expert_groups", "topk_group": "num_groups_per_token",
    "routed_scaling_factor": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
    "scoring_func": None, "topk_method": None, "hidden_act": None, "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta", "rope_interleave": "rope_interleave", "rope_parameters": None,
    "max_position_embeddings": "max_position_embeddings", "num_nextn_predict_layers": "num_mtp_layers",
    "initializer_range": "initializer_range", "tie_word_embeddings": None, "attention_bias": None,
}
# The values DeepSeek-V3 fixes; a config.json with another one is refused.
_HF_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
             "tie_word_embeddings": False, "attention_bias": False}


def _hf_to_fields(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    def need(key):
        if key not in hf:
            raise ConfigError(f"{source}: missing required field {key!r}")
        return hf[key]

    for key, allowed in _HF_FIXED.items():
        if key in hf and hf[key] != allowed:
            raise ConfigError(f"{source}: {key}={hf[key]!r} is not supported (DeepSeek-V3 uses {allowed!r})")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    yarn = None
    if rope_type == "yarn":
        yarn = YarnConfig(
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings")
                                                 or need("max_position_embeddings")),
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)),
        )
    elif rope_type != "default":
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (use 'yarn' or 'default')")
    optional = {  # the keys a config.json may leave out, with HF's defaults
        "first_k_dense_replace": hf.get("first_k_dense_replace", 0), "q_lora_rank": hf.get("q_lora_rank"),
        "n_shared_experts": hf.get("n_shared_experts") or 0, "n_group": hf.get("n_group") or 1,
        "topk_group": hf.get("topk_group") or 1,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "rope_interleave": bool(hf.get("rope_interleave", True)),
        "num_nextn_predict_layers": hf.get("num_nextn_predict_layers") or 0,
        "initializer_range": float(hf.get("initializer_range", 0.02)),
    }
    fields = {field: optional[key] if key in optional else need(key)
              for key, field in _HF_FIELDS.items() if field is not None and key != "num_key_value_heads"}
    fields["yarn"] = yarn
    if hf.get("model_type") == "deepseek_v32" or any(key in hf for key in INDEXER_FIELDS):
        fields |= {key: need(key) for key in INDEXER_FIELDS}
    scale_fmt = (hf.get("quantization_config") or {}).get("scale_fmt")
    fields["scale_fmt"] = None if scale_fmt == "float" else scale_fmt  # transformers' name for plain fp32 scales
    if hf.get("num_key_value_heads", fields["num_heads"]) != fields["num_heads"]:
        raise ConfigError(f"{source}: num_key_value_heads must equal num_attention_heads in MLA")
    return fields

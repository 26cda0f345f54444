"""The tiny configs the HF parity tests run. Between them: q_lora_rank set and null, groups with
topk_group < n_group, YaRN on (with and without a cos/sin attention factor) and off, interleaved
and rotate_half rope, zero, one and several dense first layers, batch > 1, sharded HF folders."""

from dsv3_jax.config import ModelConfig, YarnConfig

_BASE = dict(vocab_size=128, initializer_range=0.02,
             param_dtype="float32", compute_dtype="float32", num_mtp_layers=0)

PARITY_CONFIGS = {
    # q LoRA, 4 groups keep 2, YaRN (mscale == mscale_all_dim), 1 dense of 3 layers.
    "lora_groups_yarn": dict(
        cfg=ModelConfig.tiny(**_BASE), batch=2, length=12, shard_bytes=None),
    # q_proj (no LoRA), no YaRN, 2 dense of 4 layers, groups that keep everything.
    "no_lora_plain_rope": dict(
        cfg=ModelConfig.tiny(**_BASE, q_lora_rank=None, yarn=None, num_layers=4, num_dense_layers=2,
                             num_routed_experts=8, num_expert_groups=2, num_groups_per_token=2,
                             num_experts_per_token=2, num_heads=2),
        batch=3, length=10, shard_bytes=None),
    # YaRN with an attention factor != 1 (mscale != mscale_all_dim), rotate_half rope,
    # 8 groups of 2 keep 3, two shared experts.
    "yarn_mscale_halves": dict(
        cfg=ModelConfig.tiny(**_BASE, q_lora_rank=32, rope_interleave=False, num_expert_groups=8,
                             num_groups_per_token=3, num_shared_experts=2, hidden_size=48, max_position_embeddings=512,
                             yarn=YarnConfig(factor=8.0, original_max_position_embeddings=64, mscale=0.707,
                                             mscale_all_dim=1.0, beta_fast=16.0, beta_slow=2.0)),
        batch=2, length=14, shard_bytes=None),
    # Every layer MoE, 3 groups keep 1, saved as an index with several shards.
    "all_moe_sharded": dict(
        cfg=ModelConfig.tiny(**_BASE, num_dense_layers=0, num_layers=2, num_routed_experts=12,
                             num_expert_groups=3, num_groups_per_token=1, num_experts_per_token=2),
        batch=2, length=16, shard_bytes=60_000),
}

# Two MTP depths, checked against HF's own MtpModel (transformers.modeling_layers).
MTP_CONFIG = dict(cfg=ModelConfig.tiny(**{**_BASE, "num_mtp_layers": 2}), batch=2, length=9)

"""The DeepSeek-V3 pretraining recipe (paper section 4.2) on the 671B architecture.

Needs a mesh of many accelerators (the sharding package); on one host it only shows the recipe.
Pretraining ran at a 4K context without YaRN (added in the later context-extension stage).
"""

import ml_collections

from experiments.configs.base import base_config


def get_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.model = ml_collections.ConfigDict(dict(
        vocab_size=129280,  # DeepSeek-V3 tokenizer (set data.tokenizer to it)
        hidden_size=7168,  # D
        intermediate_size=18432,  # dense-layer SwiGLU hidden size
        moe_intermediate_size=2048,  # per routed/shared expert
        num_layers=61,  # transformer layers ...
        num_dense_layers=3,  # ... of which the first 3 are dense
        num_heads=128,  # attention heads
        q_lora_rank=1536,  # query low-rank compression
        kv_lora_rank=512,  # the cached KV latent
        qk_nope_head_dim=128,  # per-head query/key dims without rope
        qk_rope_head_dim=64,  # the shared rope key dims
        v_head_dim=128,  # per-head value dims
        num_routed_experts=256,  # E
        num_shared_experts=1,  # always-on expert
        num_experts_per_token=8,  # top-k
        num_expert_groups=8,  # groups of 32 experts (one per node in the paper) ...
        num_groups_per_token=4,  # ... of which each token reaches at most 4
        routed_scaling_factor=2.5,  # gate scale
        norm_topk_prob=True,  # normalise the top-k gates before scaling
        rms_norm_eps=1e-6,  # RMSNorm epsilon
        rope_theta=10000.0,  # rope base
        rope_interleave=True,  # DeepSeek's adjacent-pair rope layout
        max_position_embeddings=4096,  # pretraining context
        yarn=None,  # no YaRN during pretraining
        num_mtp_layers=1,  # one MTP depth
        index_n_heads=0,  # V3.2's lightning indexer heads; 0: none (sparse attention is not implemented)
        index_head_dim=0,  # its head dim (V3.2: 128)
        index_topk=0,  # keys each query keeps (V3.2: 2048)
        scale_fmt=ml_collections.config_dict.placeholder(str),  # FP8 block scales: None (fp32) or "ue8m0" (V3.1)
        initializer_range=0.006,  # init std (paper)
        param_dtype="float32",  # fp32 master weights
        compute_dtype="bfloat16",  # bf16 compute (the paper's FP8 GEMMs are a kernel choice)
        moe_impl="auto",  # ragged_dot on TPU/GPU
        moe_tile_size=128,  # tile bound of the tiled grouped matmul (CPU only)
        attention_impl="xla",  # "pallas" for the flash kernel
        head_loss_impl="chunked",  # head + cross-entropy fused per token chunk; "full": whole logits
        fp8_matmul=False,  # True: MLA, MLP and expert matmuls in FP8 (1x128 / 128x128 block scales)
        expert_capacity_factor=ml_collections.config_dict.placeholder(float),  # None: dropless; cf x the rows
        expert_exchange="auto",  # ragged_all_to_all on TPU/GPU, padded all_to_all on CPU
        remat=True,  # recompute activations in the backward pass, as the paper does
        unroll_max_layers=0,  # 0: the host decides (dsv3_jax/host.py: short stacks unrolled on one CPU device)
        pipeline_microbatches=0,  # pipeline meshes: 0 = fewest microbatches with bubble <= 0.2
        pipeline_repeats=1,  # 1 = GPipe; R > 1 = circular schedule, bubble (S-1)/(R*M+S-1)
        pipeline_schedule="gpipe",  # gpipe | circular (repeats > 1) | 1f1b | dualpipev (sharding/pipeline.py)
        outer_microbatches=0,  # embedding, dense layers, head, MTP, loss in microbatches; 0: one row per device on pipeline meshes
    ))
    c.data.seq_len = 4096  # T
    c.data.batch_size = 15360  # the paper's final global batch (it ramps up from 3072); per process
    c.optimizer.warmup_steps = 2000  # paper
    c.optimizer.moment_dtype = "bfloat16"  # paper: AdamW moments in BF16, master weights in FP32
    c.train.workdir = "runs/deepseek_v3_671b"  # default output folder
    c.train.steps = 235000  # 14.8T tokens / (15360 x 4096) tokens per step
    c.train.log_every = 10  # metrics line every 10 steps
    c.train.eval_every = 1000  # eval loss every 1000 steps
    c.train.eval_batches = 4  # held-out batches per eval
    c.train.checkpoint_every = 500  # checkpoint every 500 steps
    return c

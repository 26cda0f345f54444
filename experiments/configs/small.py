"""A ~0.5B-parameter DeepSeek-V3 (~90M activated) for a single accelerator.

    python -m experiments.train --config=experiments/configs/small.py --workdir=runs/small \
        --config.data.path='corpus/*.jsonl' --config.data.tokenizer=TOKENIZER --config.model.vocab_size=V
"""

import ml_collections

from experiments.configs.base import base_config


def get_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.model = ml_collections.ConfigDict(dict(
        vocab_size=2048,  # the bundled tokenizer; set to your tokenizer's size with data.tokenizer
        hidden_size=768,  # D
        intermediate_size=2048,  # dense-layer SwiGLU hidden size
        moe_intermediate_size=256,  # per routed/shared expert
        num_layers=12,  # transformer layers ...
        num_dense_layers=1,  # ... of which the first is dense
        num_heads=12,  # attention heads
        q_lora_rank=384,  # query low-rank compression
        kv_lora_rank=256,  # the cached KV latent
        qk_nope_head_dim=64,  # per-head query/key dims without rope
        qk_rope_head_dim=32,  # the shared rope key dims
        v_head_dim=64,  # per-head value dims
        num_routed_experts=64,  # E
        num_shared_experts=1,  # always-on experts
        num_experts_per_token=6,  # top-k
        num_expert_groups=8,  # groups of 8 experts ...
        num_groups_per_token=4,  # ... of which each token keeps the best 4 (as in the 671B model)
        routed_scaling_factor=2.5,  # gate scale, as in the 671B model
        norm_topk_prob=True,  # normalise the top-k gates before scaling
        rms_norm_eps=1e-6,  # RMSNorm epsilon
        rope_theta=10000.0,  # rope base
        rope_interleave=True,  # DeepSeek's adjacent-pair rope layout
        max_position_embeddings=4096,  # longest context the run uses
        yarn=None,  # pretraining runs at the native context (the paper adds YaRN afterwards)
        num_mtp_layers=1,  # one multi-token-prediction depth
        index_n_heads=0,  # V3.2's lightning indexer heads; 0: none (sparse attention is not implemented)
        index_head_dim=0,  # its head dim (V3.2: 128)
        index_topk=0,  # keys each query keeps (V3.2: 2048)
        scale_fmt=ml_collections.config_dict.placeholder(str),  # FP8 block scales: None (fp32) or "ue8m0" (V3.1)
        initializer_range=0.006,  # init std of the 671B model
        param_dtype="float32",  # fp32 master weights
        compute_dtype="bfloat16",  # bf16 matmuls; router, softmax and norms stay fp32
        moe_impl="auto",  # ragged_dot on TPU/GPU, tiled grouped matmul on CPU
        moe_tile_size=128,  # tile bound of the tiled grouped matmul
        attention_impl="xla",  # "pallas" for the flash kernel
        head_loss_impl="chunked",  # head + cross-entropy fused per token chunk; "full": whole logits
        fp8_matmul=False,  # True: MLA, MLP and expert matmuls in FP8 (1x128 / 128x128 block scales)
        expert_capacity_factor=ml_collections.config_dict.placeholder(float),  # None: dropless; cf x the rows
        expert_exchange="auto",  # ragged_all_to_all on TPU/GPU, padded all_to_all on CPU
        remat=True,  # keeps one layer's activations: batch 8 x 1024 trains in ~15 GB (without: ~23 GB)
        unroll_max_layers=0,  # 0: the host decides (dsv3_jax/host.py: short stacks unrolled on one CPU device)
        pipeline_microbatches=0,  # pipeline meshes: 0 = fewest microbatches with bubble <= 0.2
        pipeline_repeats=1,  # 1 = GPipe; R > 1 = circular schedule, bubble (S-1)/(R*M+S-1)
        pipeline_schedule="gpipe",  # gpipe | circular (repeats > 1) | 1f1b | dualpipev (sharding/pipeline.py)
        outer_microbatches=0,  # embedding, dense layers, head, MTP, loss in microbatches; 0: one row per device on pipeline meshes
    ))
    c.data.seq_len = 1024  # T
    c.data.batch_size = 64  # 64K tokens per step
    c.optimizer.peak_lr = 1e-3  # larger than the 671B rate for a smaller model
    c.optimizer.end_lr = 1e-4  # a tenth of the peak, as in the paper
    c.optimizer.final_lr = 3.3e-5  # the paper's final step-down ratio
    c.optimizer.warmup_steps = 500  # ~2% of the run
    c.train.workdir = "runs/small"  # default output folder
    c.train.steps = 20000  # ~1.3B tokens
    c.train.log_every = 20  # metrics line every 20 steps
    c.train.eval_every = 500  # eval loss every 500 steps
    c.train.eval_batches = 16  # held-out batches per eval
    c.train.checkpoint_every = 1000  # checkpoint every 1000 steps
    return c

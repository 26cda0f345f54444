"""The sections every training config shares; presets fill `model` and adjust the rest.

Sections: model (ModelConfig fields), data, optimizer, loss, balancing, train. The values here
are the DeepSeek-V3 recipe (paper section 4.2) unless a preset says otherwise.
"""

import ml_collections
from ml_collections import config_dict


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.data = ml_collections.ConfigDict()
    c.data.path = config_dict.placeholder(str)  # glob(s) of .txt/.jsonl/.arrayrecord; None: bundled fortunes
    c.data.tokenizer = config_dict.placeholder(str)  # tokenizer.json or HF folder; None: bundled 2048-id BPE
    c.data.text_field = "text"  # JSON field holding a document in .jsonl files
    c.data.add_bos = False  # prepend BOS to each document (EOS is always appended)
    c.data.seq_len = 4096  # T, model input length (the pipeline packs rows of T + 1 tokens)
    c.data.batch_size = 1920  # rows per step on this process (paper: 15360 global at the end)
    c.data.eval_fraction = 0.01  # documents held out for the eval loss
    c.data.seed = 0  # shuffle and packing seed
    c.data.num_workers = 0  # grain worker processes; 0 reads in the training process
    c.data.format = "text"  # "text": documents, every token a target; "chat": .jsonl of {"messages": [...]}, loss
    #                         on assistant tokens only, data.path None = the bundled chat set (docs/finetuning.md)
    c.data.chat_template = config_dict.placeholder(str)  # chat: a jinja template file; None: the tokenizer's own
    c.data.pretrain_eval = False  # also report the held-out loss of the pretraining corpus (pretrain_eval_loss)
    c.data.pretrain_path = config_dict.placeholder(str)  # that corpus, globs as data.path; None: bundled fortunes
    c.data.pretrain_eval_fraction = 0.01  # the pretraining run's data.eval_fraction: its held-out documents

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.schedule = "deepseek"  # "deepseek" (warmup, constant, cosine, step-down) or "wsd"
    c.optimizer.peak_lr = 2.2e-4  # paper's peak learning rate
    c.optimizer.end_lr = 2.2e-5  # cosine target (deepseek) / decay target (wsd)
    c.optimizer.final_lr = 7.3e-6  # deepseek: last step-down
    c.optimizer.warmup_steps = 2000  # linear warmup from 0
    c.optimizer.constant_end = 10.0 / 14.8  # deepseek: constant until this run fraction (10T of 14.8T tokens)
    c.optimizer.cosine_end = 14.3 / 14.8  # deepseek: cosine decay ends here (after 4.3T more tokens)
    c.optimizer.final_start = (14.8 - 0.167) / 14.8  # deepseek: final_lr for the last 167B tokens
    c.optimizer.decay_fraction = 0.2  # wsd: linear decay over this last fraction of the run
    c.optimizer.b1 = 0.9  # AdamW beta1
    c.optimizer.b2 = 0.95  # AdamW beta2
    c.optimizer.eps = 1e-8  # AdamW epsilon
    c.optimizer.weight_decay = 0.1  # on matrices only (see dsv3_jax/train/optimizer.py)
    c.optimizer.clip_norm = 1.0  # global gradient-norm clipping
    c.optimizer.moment_dtype = "float32"  # AdamW moments: "float32" or "bfloat16" (paper's FP8 recipe)

    c.loss = ml_collections.ConfigDict()
    c.loss.mtp_weight = 0.3  # lambda on the MTP loss (paper: 0.3 for the first 10T tokens, then 0.1)
    c.loss.balance_weight = 1e-4  # alpha on the sequence-wise balance loss
    c.loss.indexer_weight = 0.0  # V3.2: weight of the lightning indexers' KL to the main attention (0: not trained)

    c.balancing = ml_collections.ConfigDict()
    c.balancing.bias_update_speed = 1e-3  # gamma of the aux-loss-free bias update (0 switches it off)

    c.mesh = ml_collections.ConfigDict()  # device mesh (sharding/mesh.py); one axis may be -1 (the rest)
    c.mesh.pipeline = 1  # stages of the MoE layer stack
    c.mesh.data = -1  # data parallel (replicated parameters)
    c.mesh.fsdp = 1  # data parallel with parameters and optimizer state sharded (ZeRO-3)
    c.mesh.expert = 1  # routed experts split over this axis (tokens also split over it)
    c.mesh.tensor = 1  # heads / hidden / vocab split (Megatron-style)
    c.mesh.dcn_data = 1  # multi-slice TPU: slices the data axis spans (the only axis crossing DCN)
    c.mesh.rules = "default"  # logical-axis rules preset (sharding/rules.py PRESETS)

    c.train = ml_collections.ConfigDict()
    c.train.workdir = "runs/default"  # metrics.jsonl, tensorboard/, checkpoints/ (flag --workdir)
    c.train.steps = 1000  # total optimizer steps (flag --steps); the schedule spans them
    c.train.seed = 0  # parameter init and step RNG
    c.train.init_from = config_dict.placeholder(str)  # converted checkpoint / HF folder (flag --init_from)
    c.train.trainable = "all"  # "all", or "indexer": only the lightning indexers learn (DSA's dense warm-up)
    c.train.log_every = 10  # steps between metrics.jsonl lines
    c.train.eval_every = 100  # steps between eval losses (0: never)
    c.train.eval_batches = 8  # held-out batches per eval
    c.train.checkpoint_every = 500  # steps between checkpoints (plus the last step and SIGTERM)
    c.train.keep_checkpoints = 3  # newest checkpoints kept on disk
    c.train.max_consecutive_skips = 10  # stop after this many non-finite steps in a row
    c.train.compilation_cache = "~/.cache/dsv3_jax/xla"  # persistent XLA cache for restarts; "" turns it off
    c.train.peak_flops_per_device = 0.0  # for MFU; 0: device table, or a matmul benchmark on CPU
    return c

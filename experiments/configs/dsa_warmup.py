"""DeepSeek Sparse Attention, stage 1: the dense warm-up of the lightning indexer (DeepSeek-V3.2
report, continued pre-training). From a V3.1-shaped run (no indexer: one is initialised fresh),
attention stays dense (`index_topk` = the sequence length, so each query keeps every key), every
parameter but the indexers' is frozen, and the indexers learn the main attention's distribution
(summed over heads) through their KL loss alone; router biases stay put too, so the model itself is
unchanged. Stage 2 is dsa_sparse.py.

    python -m experiments.train --config=experiments/configs/dsa_warmup.py --init_from=RUN_OR_CKPT \
        [--workdir=runs/dsa_warmup] [--steps=...]

--init_from is a run folder of experiments.train or a converted Orbax checkpoint; its architecture
replaces config.model except the indexer's fields below (docs/finetuning.md, "Training DeepSeek
Sparse Attention"). The log's `indexer_loss` is the indexers' KL summed over the layers.
"""

import ml_collections

from experiments.configs import tiny

INDEX_N_HEADS = 4  # V3.2: 64
INDEX_HEAD_DIM = 32  # V3.2: 128; more than qk_rope_head_dim (the indexer ropes that many dims)


def get_config() -> ml_collections.ConfigDict:
    c = tiny.get_config()  # the tiny architecture and batch; --init_from brings the real architecture
    c.model.index_n_heads = INDEX_N_HEADS  # lightning indexer heads
    c.model.index_head_dim = INDEX_HEAD_DIM  # its head dim
    c.model.index_topk = c.data.seq_len  # every key kept: dense attention during the warm-up
    c.loss.indexer_weight = 1.0  # the only loss with a gradient here
    c.train.trainable = "indexer"  # the indexers learn; everything else is frozen
    c.balancing.bias_update_speed = 0.0  # the router biases are the model's too: frozen
    c.optimizer.schedule = "wsd"  # the report's warm-up: a constant rate (1e-3 for 1000 steps)
    c.optimizer.peak_lr = 1e-3
    c.optimizer.end_lr = 1e-3
    c.optimizer.warmup_steps = 0
    c.train.steps = 100
    c.train.workdir = "runs/dsa_warmup"
    return c

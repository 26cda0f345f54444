"""DeepSeek Sparse Attention, stage 2: sparse training (DeepSeek-V3.2 report, continued
pre-training), from the dense warm-up's run (dsa_warmup.py). Each query attends to the `index_topk`
keys its lightning indexer scores highest; every parameter trains, the main model through sparse
attention by the language-model losses, the indexer (its input detached) by its KL to the main
attention over the selected keys only.

    python -m experiments.train --config=experiments/configs/dsa_sparse.py --init_from=runs/dsa_warmup \
        [--workdir=runs/dsa_sparse] [--steps=...]

--init_from's architecture replaces config.model except the indexer's fields (their sizes must
match the warm-up's; `index_topk` is this stage's). The log's `indexer_loss` is the indexers' KL.
"""

import ml_collections

from experiments.configs import dsa_warmup, tiny


def get_config() -> ml_collections.ConfigDict:
    c = tiny.get_config()  # the whole model trains, with the tiny recipe's schedule
    c.model.index_n_heads = dsa_warmup.INDEX_N_HEADS  # the warm-up's indexer
    c.model.index_head_dim = dsa_warmup.INDEX_HEAD_DIM
    c.model.index_topk = c.data.seq_len // 4  # each query reads a quarter of the sequence at most (V3.2: 2048)
    c.loss.indexer_weight = 1.0  # the indexers' KL over the selected keys (their input detached)
    c.optimizer.warmup_steps = 0  # continued training: the weights are trained already
    c.train.steps = 100
    c.train.workdir = "runs/dsa_sparse"
    return c

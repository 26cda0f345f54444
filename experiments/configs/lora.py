"""LoRA fine-tuning: adapters on every MLA projection and the dense/shared MLPs (optionally the
routed experts), base weights frozen, the optimizer holding state for the adapters only.

    python -m experiments.train --config=experiments/configs/lora.py --init_from=RUN_OR_HF \
        --workdir=runs/lora [--config.data.path=chat.jsonl] [--config.lora.experts=True]

`--init_from` is a run folder of experiments.train, a converted Orbax checkpoint or an HF folder
(its architecture replaces config.model; the dtypes and implementation switches below stay). The
run checkpoints base and adapters together and resumes like pretraining; export with
`python -m dsv3_jax.convert --to-hf --ckpt=RUN --out=DIR` (merged weights).
"""

import ml_collections

from dsv3_jax.model.lora import DEFAULT_TARGETS
from experiments.configs.tiny import get_config as tiny_config


def get_config() -> ml_collections.ConfigDict:
    c = tiny_config()  # the model section (used without --init_from) and the shared sections
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 8  # r: A is [in, r], B is [r, out]
    c.lora.alpha = 16.0  # the update is scaled by alpha / rank
    c.lora.targets = DEFAULT_TARGETS  # regex fully matching weight paths (e.g. "moe_layers/attn/wq_a")
    c.lora.experts = False  # True: per-expert adapters on the routed experts too (inside the grouped matmul)
    c.lora.train_router_bias = False  # keep moving the router biases by the balancing rule (False: frozen)
    c.lora.seed = 0  # draws of the A matrices
    c.optimizer.schedule = "wsd"  # warmup, constant, linear decay: fine-tuning runs are short
    c.optimizer.peak_lr = 2e-3  # adapters start at zero update and take a larger rate than full tuning
    c.optimizer.end_lr = 2e-4  # a tenth of the peak at the end
    c.optimizer.warmup_steps = 10  # short warmup
    c.optimizer.decay_fraction = 0.2  # decay over the last fifth
    c.optimizer.weight_decay = 0.0  # the adapters are a small update: no decay
    c.train.workdir = "runs/lora"  # default output folder
    c.train.steps = 100  # a short fine-tune
    c.train.eval_every = 25  # eval loss four times
    c.train.checkpoint_every = 50  # two checkpoints
    return c

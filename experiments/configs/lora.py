"""LoRA fine-tuning on chat data: sft.py (chat format, assistant-only loss, both held-out losses,
router biases frozen) with adapters on every MLA projection and the dense/shared MLPs (optionally
the routed experts); base weights frozen, the optimizer holding state for the adapters only.

    python -m experiments.train --config=experiments/configs/lora.py --init_from=RUN_OR_HF \
        --config.data.path=chat.jsonl [--workdir=runs/lora] [--config.lora.experts=True]

Without --config.data.path it trains on the bundled chat set (dsv3_jax/data/assets/chat.jsonl).
`--init_from` is a run folder of experiments.train, a converted Orbax checkpoint, an HF folder or
a PEFT adapter folder (its architecture replaces config.model; the dtypes and implementation
switches stay). The run checkpoints base and adapters together and resumes like pretraining;
export with `python -m dsv3_jax.convert --to-hf --ckpt=RUN --out=DIR` (merged weights).
Router biases stay frozen as in sft.py; --config.balancing.bias_update_speed=1e-3 keeps moving them.
QLoRA: --config.lora.base_weights=int4 (or int8, fp8) keeps the base quantized (one device).
"""

import ml_collections

from dsv3_jax.model.lora import DEFAULT_TARGETS
from experiments.configs import sft


def get_config() -> ml_collections.ConfigDict:
    c = sft.get_config()  # chat data, both held-out losses, frozen router biases, the fine-tuning schedule
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 8  # r: A is [in, r], B is [r, out]
    c.lora.alpha = 16.0  # the update is scaled by alpha / rank
    c.lora.dropout = 0.0  # drop rate of the adapters' inputs in training steps (not eval, generate, merge)
    c.lora.targets = DEFAULT_TARGETS  # regex fully matching weight paths (e.g. "moe_layers/attn/wq_a")
    c.lora.experts = False  # True: per-expert adapters on the routed experts too (inside the grouped matmul)
    c.lora.seed = 0  # draws of the A matrices
    c.lora.base_weights = "none"  # QLoRA: "fp8", "int8" or "int4" loads the frozen base quantized (adapters fp32)
    c.lora.base_quantize = "all"  # with base_weights: "all" projections quantized, or the routed "experts" only
    c.optimizer.peak_lr = 2e-3  # adapters start at zero update and take a larger rate than full tuning
    c.optimizer.end_lr = 2e-4  # a tenth of the peak at the end
    c.train.workdir = "runs/lora"  # default output folder
    return c

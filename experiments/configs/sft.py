"""Full supervised fine-tuning on chat data: every parameter trains, the loss counts assistant tokens only.

    python -m experiments.train --config=experiments/configs/sft.py --init_from=RUN_OR_HF \
        [--config.data.path=chat.jsonl] [--workdir=runs/sft]

--init_from is a training run's folder (e.g. runs/tiny), one of its steps, a converted checkpoint or
an HF folder; its architecture replaces config.model (the tiny one here only applies without it).
Without --config.data.path it trains on the bundled chat set (dsv3_jax/data/assets/chat.jsonl).

Data fields a fine-tuning config sets (experiments/configs/base.py documents them all):
  data.format = "chat"          jsonl {"messages": [{"role", "content"}, ...]} per line, rendered by the
                                tokenizer's chat template; loss on the template's {% generation %} spans
  data.chat_template            a jinja file to use instead of the tokenizer's template (None: its own)
  data.pretrain_eval = True     eval also reports pretrain_eval_loss: the pretraining corpus's held-out loss
  data.pretrain_path            that corpus (None: the bundled fortunes, what the tiny config pretrains on)
Router biases are frozen (balancing.bias_update_speed = 0): fine-tuning data is narrow and would move
the pretrained balance; --config.balancing.bias_update_speed=1e-3 keeps moving them.
"""

import ml_collections

from experiments.configs import tiny


def get_config() -> ml_collections.ConfigDict:
    c = tiny.get_config()  # the tiny architecture and batch; --init_from brings the real architecture
    c.data.format = "chat"  # conversations; only assistant tokens are targets
    c.data.path = None  # None: the bundled chat set; else globs of .jsonl chat files
    c.data.eval_fraction = 0.1  # 48 of the bundled 480 conversations held out for eval_loss
    c.data.pretrain_eval = True  # report the pretraining held-out loss beside it (forgetting)
    c.data.pretrain_path = None  # the bundled fortunes, which the tiny config pretrains on
    c.data.pretrain_eval_fraction = 0.01  # the tiny pretraining run's eval_fraction: the same held-out documents
    c.balancing.bias_update_speed = 0.0  # router biases frozen; 1e-3 keeps moving them
    c.optimizer.schedule = "wsd"  # warmup, constant, then a linear decay over the last fifth
    c.optimizer.peak_lr = 1e-3  # a third of the tiny pretraining peak
    c.optimizer.end_lr = 1e-4  # decay target
    c.optimizer.warmup_steps = 10  # short warmup from the pretrained weights
    c.optimizer.weight_decay = 0.0  # no pull of the pretrained weights towards zero
    c.train.workdir = "runs/sft"  # default output folder
    c.train.steps = 100  # ~6 passes over the bundled set (about 32 conversations a step)
    c.train.log_every = 10  # a metrics line every 10 steps
    c.train.eval_every = 20  # eval_loss and pretrain_eval_loss every 20 steps (a multiple of log_every) and at step 0
    c.train.eval_batches = 4  # the whole held-out chat split; 4 x 16 rows of fortunes
    c.train.checkpoint_every = 50  # 2 checkpoints over the run
    return c

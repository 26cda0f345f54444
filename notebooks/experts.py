# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # How the experts are used: the auxiliary-loss-free bias update
#
# DeepSeek-V3 balances its experts without an auxiliary loss on the main objective: each routed
# expert has a bias that is added to its score for the *selection* only, and after every step the
# bias of an overloaded expert goes down by gamma and that of an underloaded one goes up
# (`docs/numerics.md`, Router). Here the same small model trains twice on the bundled corpus, with
# the update (gamma > 0) and without it (gamma = 0), and we draw the expert load per layer and the
# MaxVio curve (max load / mean load - 1) of both runs.
#
# **Run time: about 40 s on a 2-core CPU**: the kernel used 36 s of CPU time (jax 0.10.2,
# executed by `tests/test_notebooks.py`); on a shared machine at a load average of 22 the same run
# took 132 s of wall time. The last cell prints this run's figures.
# For a longer, scripted version: `python -m research.balance_experiment`.

# %%
import time

_start, _cpu_start = time.perf_counter(), time.process_time()

import jax.numpy as jnp
import matplotlib.pyplot as plt
import ml_collections
import numpy as np
from flax import nnx

from dsv3_jax import DeepSeekV3, ModelConfig
from dsv3_jax.data import DataConfig, load_tokenizer, make_dataset
from dsv3_jax.train import balancing, optimizer, state as state_lib, step as step_lib
from experiments import plot

# %% [markdown]
# ## One model, one train step, two values of gamma
#
# Two MoE layers (model layers 1 and 2; layer 0 is dense) of 16 experts, top-4. gamma is an
# argument of the jitted step, so both runs share one compiled program. The paper uses gamma =
# 0.001 over hundreds of thousands of steps; a run this short needs a faster update to show it.

# %%
STEPS, GAMMA = 60, 0.01
cfg = ModelConfig.tiny(vocab_size=2048, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                       num_layers=3, num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=8, v_head_dim=8, num_mtp_layers=0)
opt = ml_collections.ConfigDict(dict(schedule="wsd", peak_lr=3e-3, end_lr=3e-4, warmup_steps=5, decay_fraction=0.2,
                                     b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0))
tok = load_tokenizer()
model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
_, params, _ = state_lib.split_model(model)
tx = optimizer.make_optimizer(opt, STEPS, optimizer.decay_mask(params))
graphdef, initial_state = state_lib.init_train_state(model, tx, seed=0)
train_step = step_lib.make_train_step(graphdef, tx, optimizer.make_schedule(opt, STEPS), mtp_weight=0.0,
                                      balance_weight=1e-4, bias_update_speed=0.0)


def load_record(counts_LxE) -> dict:
    """MaxVio per MoE layer and each expert's share of the layer's routed tokens."""
    counts_LxE = np.asarray(counts_LxE, np.float64)
    share_LxE = counts_LxE / counts_LxE.sum(axis=-1, keepdims=True)
    return {"maxvio": np.asarray(balancing.max_violation(counts_LxE)).tolist(), "expert_load": share_LxE.tolist()}


def train(gamma: float) -> list[dict]:
    """STEPS steps from the same initial state and batches; one record per step."""
    state, records = initial_state, []
    batches = iter(make_dataset(DataConfig(seq_len=33, batch_size=8), "train", tokenizer=tok))
    for step in range(1, STEPS + 1):
        state, m = train_step(state, next(batches), bias_update_speed=jnp.float32(gamma))
        records.append({"step": step, "lm_loss": float(m["lm_loss"]), **load_record(m["expert_counts"])})
    records[-1]["bias"] = np.asarray(state.router_bias["moe_layers"]["ffn"]["gate"]["bias"])
    return records


runs = {gamma: train(gamma) for gamma in (GAMMA, 0.0)}
for gamma, records in runs.items():
    tail = records[-STEPS // 5:]
    print(f"gamma={gamma:g}: mean MaxVio over the last {len(tail)} steps {np.mean([r['maxvio'] for r in tail]):.3f}, "
          f"lm loss {records[-1]['lm_loss']:.3f}, |bias| max {np.abs(records[-1]['bias']).max():.3f}")

# %% [markdown]
# ## MaxVio per step
#
# MaxVio is taken per batch and averaged over the MoE layers (`dsv3_jax/train/balancing.py`,
# `max_violation`). 0 is a perfectly even load.

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for gamma, records in runs.items():
    ax.plot([r["step"] for r in records], [np.mean(r["maxvio"]) for r in records], label=f"gamma = {gamma:g}")
ax.set(xlabel="step", ylabel="max load / mean load - 1", title="MaxVio (batch, mean over MoE layers)")
ax.legend()
plt.show()

# %% [markdown]
# ## Expert load per layer
#
# The share of routed tokens each expert received, averaged over the last 20% of steps
# (`experiments.plot.expert_load_figure`, the heatmap `python -m experiments.plot` draws for a
# training run). Rows are labelled with the model's layer numbers; a balanced row is flat at 1/16.

# %%
moe_layers = list(range(cfg.num_dense_layers, cfg.num_layers))
for gamma, records in runs.items():
    fig = plot.expert_load_figure(records, moe_layers)
    fig.axes[0].set_title(f"gamma = {gamma:g}: " + fig.axes[0].get_title())
    plt.show()

# %%
print(f"notebook run time: {time.perf_counter() - _start:.0f} s wall, "
      f"{time.process_time() - _cpu_start:.0f} s CPU")

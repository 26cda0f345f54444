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
# # dsv3-jax quickstart: the model under `jax.jit`
#
# Build a small DeepSeek-V3 (MLA, DeepSeekMoE, multi-token prediction), run its forward under
# `jax.jit` and `nnx.jit`, look at the MTP logits and the router statistics, generate text with the
# bundled tokenizer, train 20 steps with the library's train step, and plot the loss.
#
# **Run time: about 50 s on a 2-core CPU**: the kernel used 46 s of CPU time (jax 0.10.2,
# executed by `tests/test_notebooks.py`); on a shared machine at a load average of 22 the same run
# took 177 s of wall time. The last cell prints this run's figures.
#
# The `.ipynb` is generated from `notebooks/quickstart.py` (jupytext, percent format):
# `jupytext --to notebook notebooks/quickstart.py`.

# %%
import time

_start, _cpu_start = time.perf_counter(), time.process_time()

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from dsv3_jax import DeepSeekV3, ModelConfig

print(jax.__version__, jax.devices())

# %% [markdown]
# ## The model
#
# `ModelConfig.tiny()` switches every feature on (q LoRA, expert groups, YaRN, a dense first layer,
# one MTP depth). We shrink it further and give it the bundled tokenizer's 2048-id vocabulary.

# %%
cfg = ModelConfig.tiny(vocab_size=2048, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                       num_layers=2, num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=8, v_head_dim=8)
model = DeepSeekV3(cfg, rngs=nnx.Rngs(0))
counts = cfg.param_counts()
print({k: f"{v / 1e3:.1f}K" for k, v in counts.items()})
print(f"{cfg.num_layers} layers ({cfg.num_dense_layers} dense), {cfg.num_routed_experts} routed experts, "
      f"top-{cfg.num_experts_per_token} in {cfg.num_groups_per_token} of {cfg.num_expert_groups} groups")

# %% [markdown]
# ## The forward under `jax.jit` and `nnx.jit`
#
# An NNX module is a Python object. Plain `jax.jit` needs pure functions of arrays, so split the
# model into a static graph definition and a state pytree, and merge them inside the traced
# function. `nnx.jit` does that split/merge for you. Both give the same logits.

# %%
tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
graphdef, state = nnx.split(model)


@jax.jit
def logits_fn(state, tokens):
    return nnx.merge(graphdef, state)(tokens)


@nnx.jit
def logits_nnx(model, tokens):
    return model(tokens)


a, b = logits_fn(state, tokens), logits_nnx(model, tokens)
print(a.shape, a.dtype, "max |jax.jit - nnx.jit| =", float(jnp.max(jnp.abs(a - b))))
assert a.shape == (2, 16, cfg.vocab_size) and jnp.allclose(a, b, atol=1e-5)

# %% [markdown]
# ## MTP logits and router statistics
#
# `model.forward` returns everything training needs: the main logits, the MTP logits (depth k at
# position i predicts token i + k + 1) and, per MoE layer, how many tokens each expert received
# and the sequence-wise balance loss.

# %%
out = nnx.jit(lambda m, t: m.forward(t))(model, tokens)
print("main logits", out.logits.shape, "  MTP logits", out.mtp_logits.shape)
counts_LxE = np.asarray(out.router_stats.expert_counts)
print(f"tokens per expert, layer {cfg.num_dense_layers} (the first MoE layer):", counts_LxE[0].astype(int).tolist())
print("routed slots:", int(counts_LxE[0].sum()), "= tokens x top-k =", tokens.size * cfg.num_experts_per_token)
print("balance loss per MoE layer:", [f"{x:.4f}" for x in np.asarray(out.router_stats.balance_loss)])

# %% [markdown]
# ## Generate text with the bundled tokenizer
#
# The model is untrained, so the text is noise; the point is the API. `generate` prefills a latent
# (MLA) cache and runs one jitted decode step per token; `use_mtp=True` drafts with the MTP module
# and gives the same greedy tokens.

# %%
from dsv3_jax.data import load_tokenizer
from dsv3_jax.inference import generate

tok = load_tokenizer()
prompt = np.array([tok.encode("The quick brown fox")], np.int32)
out_ids = generate(model, prompt, max_new_tokens=12)
print(repr(tok.decode(np.asarray(out_ids)[0])))
out_mtp = generate(model, prompt, max_new_tokens=12, use_mtp=True)
assert np.array_equal(np.asarray(out_ids), np.asarray(out_mtp))

# %% [markdown]
# ## Train 20 steps with the library's train step
#
# The same step `experiments.train` uses: forward with MTP, LM + MTP + balance losses, AdamW, then
# the auxiliary-loss-free router-bias update from this batch's expert counts. Data comes from the
# bundled corpus through the grain pipeline.

# %%
import ml_collections

from dsv3_jax.data import DataConfig, make_dataset
from dsv3_jax.train import optimizer, state as state_lib, step as step_lib

STEPS = 20
opt = ml_collections.ConfigDict(dict(schedule="wsd", peak_lr=3e-3, end_lr=3e-4, warmup_steps=3, decay_fraction=0.2,
                                     b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0))
_, params, _ = state_lib.split_model(model)
tx = optimizer.make_optimizer(opt, STEPS, optimizer.decay_mask(params))
schedule = optimizer.make_schedule(opt, STEPS)
graphdef, train_state = state_lib.init_train_state(model, tx, seed=0)
train_step = step_lib.make_train_step(graphdef, tx, schedule, mtp_weight=0.3, balance_weight=1e-4,
                                      bias_update_speed=1e-3)
batches = iter(make_dataset(DataConfig(seq_len=33, batch_size=8), "train", tokenizer=tok))

losses = []
for i in range(STEPS):
    train_state, metrics = train_step(train_state, next(batches))
    losses.append(float(metrics["lm_loss"]))
print(f"lm loss {losses[0]:.3f} -> {losses[-1]:.3f}")
assert losses[-1] < losses[0]

# %%
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(range(1, STEPS + 1), losses)
ax.set(xlabel="step", ylabel="LM loss (nats)", title="20 steps on the bundled corpus")
plt.show()

# %%
print(f"notebook run time: {time.perf_counter() - _start:.0f} s wall, "
      f"{time.process_time() - _cpu_start:.0f} s CPU")

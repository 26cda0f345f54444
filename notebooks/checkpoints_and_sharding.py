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
# # Checkpoints and sharding: an HF folder onto 8 devices
#
# Make a tiny Hugging Face DeepSeek-V3 folder with transformers, convert it to our Orbax format,
# load it onto a mesh of 8 (fake CPU) devices with a logical-axis rules preset, look at where each
# parameter lives, and compare the sharded model's logits with HF's.
#
# **Run time: about 20 s on a 2-core CPU**: the kernel used 15 s of CPU time (jax 0.10.2,
# executed by `tests/test_notebooks.py`); on a shared machine at a load average of 22 the same run
# took 52 s of wall time. The last cell prints this run's figures.
# Needs torch and transformers (the `test` extra).
#
# Eight fake devices have to be asked for before jax starts, so the first cell sets `XLA_FLAGS`
# before it imports jax. On a TPU or GPU host, drop that line and use the real devices.

# %%
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tempfile
import time

_start, _cpu_start = time.perf_counter(), time.process_time()

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import sharding
from dsv3_jax import ModelConfig, load_pretrained
from dsv3_jax.model.params import logical_axes

print(jax.device_count(), "devices:", jax.devices())
assert jax.device_count() == 8, "XLA_FLAGS was set after jax started; restart the kernel"

# %% [markdown]
# ## A tiny HF checkpoint, written by transformers
#
# `ModelConfig.to_hf_config()` gives the `config.json` fields; transformers builds its own
# `DeepseekV3ForCausalLM` from them and saves it the way hub checkpoints are saved (per-expert
# tensor names). Its default init makes near-zero logits, so we draw larger random weights and a
# random router bias: the comparison below then means something.

# %%
import torch
import transformers

cfg = ModelConfig.tiny(vocab_size=256, num_layers=3, num_dense_layers=1, num_routed_experts=8, num_expert_groups=4,
                       num_groups_per_token=2, num_experts_per_token=2, num_mtp_layers=0)
hf_cfg = transformers.DeepseekV3Config(**cfg.to_hf_config())
hf_cfg._attn_implementation = "eager"
torch.manual_seed(0)
hf_model = transformers.DeepseekV3ForCausalLM(hf_cfg).float().eval()
with torch.no_grad():
    for name, p in hf_model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape))
        else:
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    for name, b in hf_model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape))

work = tempfile.mkdtemp()
hf_dir, ckpt_dir = os.path.join(work, "hf"), os.path.join(work, "orbax")
hf_model.save_pretrained(hf_dir)
print(sorted(os.listdir(hf_dir)))

# %% [markdown]
# ## Convert to Orbax
#
# The same as `python -m dsv3_jax.convert --hf-dir HF --out CKPT`: it streams tensor by tensor
# (bounded memory at 671B) and writes the stacked layout our model uses.

# %%
from dsv3_jax.convert import main as convert

assert convert(["--hf-dir", hf_dir, "--out", ckpt_dir, "--no-progress"]) == 0
print(sorted(os.listdir(ckpt_dir)))

# %% [markdown]
# ## Load straight onto a mesh
#
# Five mesh axes exist (`data`, `fsdp`, `tensor`, `expert`, `pipeline`); here fsdp=2, tensor=2,
# expert=2. Every parameter carries logical axis names (`embed`, `vocab`, `heads`, `expert`, ...);
# a rules preset maps them to mesh axes, and each tensor is read into its `NamedSharding` directly:
# no host ever holds a whole stacked leaf.

# %%
mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "expert": 2})
rules = sharding.get_rules("default")
model = load_pretrained(ckpt_dir, mesh=mesh, rules=rules)
print(dict(mesh.shape))

for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Variable):
        value = var[...]
        name = ".".join(map(str, path))
        print(f"{name:32s} {str(value.shape):16s} {str(logical_axes(var)):48s} {value.sharding.spec}")

# %% [markdown]
# `jax.debug.visualize_array_sharding` draws a 2-D array's tiles and the devices that hold them.
# The embedding `[vocab, embed]` and the head `[embed, vocab]` both have `vocab` on tensor and
# `embed` on fsdp under the default rules; each tile is held by the two expert ranks.

# %%
jax.debug.visualize_array_sharding(model.embed[...])
jax.debug.visualize_array_sharding(model.head[...])

# %% [markdown]
# ## Same logits as HF
#
# Run the sharded model under `jax.jit` (XLA inserts the collectives the shardings call for) and
# compare with transformers on the same tokens.

# %%
tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 12)).astype(np.int32)
graphdef, state = nnx.split(model)
ours = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(tokens))
with torch.no_grad():
    theirs = hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
rel = float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())
print(f"logits {ours.shape}, sharded as {ours.sharding.spec}; max |ours - HF| / max |HF| = {rel:.2e}")
assert rel < 1e-4

# %%
print(f"notebook run time: {time.perf_counter() - _start:.0f} s wall, "
      f"{time.process_time() - _cpu_start:.0f} s CPU")

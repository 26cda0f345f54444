"""AdamW with global-norm clipping, the decay mask, and the learning-rate schedules.

DeepSeek-V3 recipe (paper section 4.2): AdamW b1 0.9, b2 0.95, weight decay 0.1, gradient
clipping at global norm 1.0; the learning rate warms up linearly, stays constant, decays by a
cosine to a tenth of the peak, then steps down twice. `wsd` (warmup, stable, linear decay) is the
common alternative for runs whose length is not known in advance.

Decay mask: weight decay applies to matrices only, i.e. every parameter with two or more
logical axes besides the stacked `layers` axis: projections, experts, router weights, the
embedding and the output head. Vectors (RMSNorm gains) are not decayed, and the router bias is
not a parameter at all (see `balancing`), so the optimizer never sees it.

Moments: `moment_dtype` "bfloat16" stores AdamW's first and second moments in bf16, as the paper
does (section 3.3.3); each update is computed in fp32 from the widened moments and only the
stored state is rounded. Master weights and gradients stay fp32.

Trainable subset: `trainable_mask` / `select` / `combine` give the optimizer only some parameters
(LoRA adapters; the lightning indexers in DSA's dense warm-up); the others are constants of the
step, with no gradient and no moments.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx, traverse_util

from dsv3_jax.model.params import LAYERS, logical_axes

# Where the paper's phases end, as fractions of the 14.8T-token run: constant until 10T, cosine
# until 14.3T, the end rate for 333B tokens, the final rate for the last 167B.
DEEPSEEK_CONSTANT_END = 10.0 / 14.8
DEEPSEEK_COSINE_END = 14.3 / 14.8
DEEPSEEK_FINAL_START = (14.8 - 0.167) / 14.8
SCHEDULES = ("deepseek", "wsd")
MOMENT_DTYPES = ("float32", "bfloat16")


def warmup_factor(step, warmup_steps: int):
    """Linear warmup that reaches 1 at step warmup_steps - 1 (so step 0 already moves)."""
    if warmup_steps <= 0:
        return jnp.ones_like(step, jnp.float32)
    return jnp.minimum(1.0, (step + 1.0) / warmup_steps)


def deepseek_schedule(total_steps: int, *, peak_lr: float, end_lr: float, final_lr: float,
                      warmup_steps: int, constant_end: float = DEEPSEEK_CONSTANT_END,
                      cosine_end: float = DEEPSEEK_COSINE_END, final_start: float = DEEPSEEK_FINAL_START):
    """Warmup -> constant peak -> cosine to end_lr -> end_lr -> final_lr; phases as run fractions."""
    if not 0.0 <= constant_end <= cosine_end <= final_start <= 1.0:
        raise ValueError(f"schedule fractions must satisfy 0 <= {constant_end=} <= {cosine_end=} "
                         f"<= {final_start=} <= 1")
    c0, c1, f0 = (frac * total_steps for frac in (constant_end, cosine_end, final_start))

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        progress = jnp.clip((s - c0) / max(c1 - c0, 1e-9), 0.0, 1.0)
        cosine = end_lr + (peak_lr - end_lr) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        lr = jnp.where(s < c0, peak_lr, jnp.where(s < c1, cosine, jnp.where(s < f0, end_lr, final_lr)))
        return lr * warmup_factor(s, warmup_steps)

    return schedule


def wsd_schedule(total_steps: int, *, peak_lr: float, end_lr: float, warmup_steps: int,
                 decay_fraction: float):
    """Warmup -> stable peak -> linear decay to end_lr over the last decay_fraction of the run."""
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must lie in [0, 1], got {decay_fraction}")
    d0 = (1.0 - decay_fraction) * total_steps

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        progress = jnp.clip((s - d0) / max(total_steps - d0, 1e-9), 0.0, 1.0)
        return (peak_lr + (end_lr - peak_lr) * progress) * warmup_factor(s, warmup_steps)

    return schedule


def make_schedule(opt, total_steps: int):
    """The schedule named by `opt.schedule` (an `optimizer` config section)."""
    if opt.schedule == "deepseek":
        return deepseek_schedule(total_steps, peak_lr=opt.peak_lr, end_lr=opt.end_lr, final_lr=opt.final_lr,
                                 warmup_steps=opt.warmup_steps, constant_end=opt.constant_end,
                                 cosine_end=opt.cosine_end, final_start=opt.final_start)
    if opt.schedule == "wsd":
        return wsd_schedule(total_steps, peak_lr=opt.peak_lr, end_lr=opt.end_lr,
                            warmup_steps=opt.warmup_steps, decay_fraction=opt.decay_fraction)
    raise ValueError(f"optimizer.schedule={opt.schedule!r} is not one of {SCHEDULES}")


def decay_mask(param_state: nnx.State) -> dict:
    """Pure dict of bools, True where weight decay applies (matrices; see the module docstring)."""
    return _variable_mask(lambda v: len([a for a in logical_axes(v) if a != LAYERS]) >= 2, param_state)


def _variable_mask(predicate, param_state: nnx.State) -> dict:
    """Pure dict of `predicate(variable)` over the variables of `param_state`."""
    return nnx.to_pure_dict(jax.tree.map(predicate, param_state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def scale_by_adam_stored_in(dtype, *, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's direction mu_hat / (sqrt(nu_hat) + eps) with mu and nu kept in `dtype` between steps."""
    def init(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros)

    def update(grads, state, params=None):
        del params
        f32 = functools.partial(jax.tree.map, lambda a: a.astype(jnp.float32))
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, f32(state.mu), f32(grads))
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, f32(state.nu), f32(grads))
        count = optax.safe_increment(state.count)
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
        updates = jax.tree.map(lambda m, v, g: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype), mu, nu, grads)
        store = functools.partial(jax.tree.map, lambda a: a.astype(dtype))
        return updates, optax.ScaleByAdamState(count=count, mu=store(mu), nu=store(nu))

    return optax.GradientTransformation(init, update)


def make_optimizer(opt, total_steps: int, mask: dict) -> optax.GradientTransformation:
    """clip_by_global_norm(opt.clip_norm) then AdamW with the schedule, the decay mask and the
    moments stored in `opt.moment_dtype` (float32 when the section predates the field)."""
    moment_dtype = opt.get("moment_dtype", "float32")
    if moment_dtype not in MOMENT_DTYPES:
        raise ValueError(f"optimizer.moment_dtype={moment_dtype!r} is not one of {MOMENT_DTYPES}")
    clip = optax.clip_by_global_norm(opt.clip_norm)
    lr = make_schedule(opt, total_steps)
    if moment_dtype == "float32":
        return optax.chain(clip, optax.adamw(lr, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                                             weight_decay=opt.weight_decay, mask=mask))
    return optax.chain(clip, scale_by_adam_stored_in(jnp.bfloat16, b1=opt.b1, b2=opt.b2, eps=opt.eps),
                       optax.add_decayed_weights(opt.weight_decay, mask),
                       optax.scale_by_learning_rate(lr))


def trainable_mask(param_state: nnx.State, wrt: type | str) -> dict:
    """Pure dict of bools over the parameters, True for the variables of type `wrt` (for LoRA,
    `nnx.LoRAParam`: the adapters train and the base stays frozen) or, `wrt` a name, for those
    inside every module of that name ("indexer": DSA's dense warm-up)."""
    if isinstance(wrt, str):
        mask = jax.tree_util.tree_map_with_path(lambda path, _: any(getattr(k, "key", None) == wrt for k in path),
                                                nnx.to_pure_dict(param_state))
    else:
        mask = _variable_mask(lambda v: isinstance(v, wrt), param_state)
    if not any(jax.tree.leaves(mask)):
        raise ValueError(f"no parameter {getattr(wrt, '__name__', wrt)!r} to train")
    return mask


def select(tree: dict, mask: dict | None) -> dict:
    """The leaves of a pure dict where `mask` is True, as a nested dict of those only (None: all).
    What the optimizer sees: its state holds moments for these leaves and no others."""
    if mask is None:
        return tree
    leaves = traverse_util.flatten_dict(tree)
    chosen = {path: leaves[path] for path, keep in traverse_util.flatten_dict(mask).items() if keep}
    return traverse_util.unflatten_dict(chosen)


def combine(tree: dict, part: dict) -> dict:
    """`tree` with the leaves of `part` (a `select`ion of it) put in their places."""
    leaves = traverse_util.flatten_dict(tree, keep_empty_nodes=True) | traverse_util.flatten_dict(part)
    return traverse_util.unflatten_dict(leaves)

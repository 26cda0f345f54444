"""LoRA (Hu et al. 2021): a frozen projection W plus a trained low-rank update, y = x W + s (x A) B.

A [*in, r] starts Gaussian (std 1/r, PEFT's "gaussian" init), B [r, *out] starts at zero, so an
adapted model starts equal to its base; s = alpha / r. Adapters are `nnx.LoRAParam`s (a subclass
of `nnx.Param`) on the module that owns W, in an `Adapter` named `<weight>_lora`; the module's own
forward adds the update through the same ops (`ops.linear.project`, the expert dispatch), so there
is one forward with or without adapters. Only LoRAParams reach the optimizer
(`train.optimizer.trainable_mask`).

Which weights can carry one is declared by their module (`LORA_TARGETS`: weight name -> number of
leading input axes it contracts); `apply` puts adapters on those whose path ("moe_layers/attn/wq_a",
"dense_layers/ffn/w1", "moe_layers/ffn/shared_experts/w2", routed experts "moe_layers/ffn/w1")
fully matches `LoRAConfig.targets`. Leading `layers` and `expert` axes stay batch axes of A and B:
every layer, and every routed expert, has its own adapter.

Dropout (`LoRAConfig.dropout`, PEFT's `lora_dropout`): in a training step each adapter's input is
x * m / (1 - p), m Bernoulli(1 - p) per element, the base projection seeing x unchanged. The step
calls `with_dropout(model, key)` on the model it differentiates, which gives adapter i of layer l
the key fold_in(key, i) split over the layers (a `DropoutKey`, sliced per layer by the layer scan);
the key is the train state's `rng`, advanced every step and checkpointed, so a resumed run draws the
masks an uninterrupted one draws. Without a key (eval, generate, serve, `merge`) no dropout.
The routed experts' adapters drop their inputs inside the grouped matmul: one mask row per sorted
(token, expert) row, drawn from the adapter's key over the sorted rows (`expert_adapters`,
`ops/dispatch.adapter_masks`), the mask travelling with its row into the tile loop (single-device
dispatch; an expert- or token-parallel mesh refuses it, `model/moe.py`).

QLoRA (Dettmers et al. 2023): `LoRAConfig.base_weights` "fp8", "int8" or "int4" keeps the base
quantized (`model/quant.py`'s `QuantizedWeight`, loaded so by `load_pretrained(weights=...)`) and
frozen; adapters on a quantized W are fp32 and the forward is W_q x + s (x A) B, the projection
dequantising W_q inside its matmul. `merge` folds s A B into the dequantized W (an `nnx.Param` in
fp32: a merged model is no longer quantized) and `unmerge` puts the quantized weight back as it was.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv3_jax.model import params
from dsv3_jax.model.quant import QuantizedWeight, stack_dims
from dsv3_jax.ops import quant
from dsv3_jax.ops.quant import QArray

# Every projection of MLA (q_a, q_b or q, kv_a, kv_b, o), the dense MLPs and the shared experts;
# routed experts ("moe_layers/ffn/w*") only with LoRAConfig.experts. MTP layers are left out.
DEFAULT_TARGETS = r"(dense_layers|moe_layers)/(attn/(wq|wq_a|wq_b|wkv_a|wkv_b|wo)|ffn/(shared_experts/)?w[123])"
BASE_WEIGHTS = ("none", *quant.FORMATS)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8  # r, inner dimension of A [*in, r] and B [r, *out]
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # drop rate of the adapter's input in training steps (`with_dropout`)
    targets: str = DEFAULT_TARGETS  # regex fully matching the paths of the weights to adapt
    experts: bool = False  # also adapt the routed experts (per-expert A, B inside the grouped matmul)
    seed: int = 0  # draws of the A matrices
    base_weights: str = "none"  # QLoRA: "fp8", "int8" or "int4" keeps the frozen base quantized
    base_quantize: str = "all"  # with base_weights: the projections held quantized ("all" or "experts")

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must lie in [0, 1), got {self.dropout}")
        if self.base_weights not in BASE_WEIGHTS:
            raise ValueError(f"lora.base_weights={self.base_weights!r} is not one of {BASE_WEIGHTS}")
        if self.base_quantize not in ("all", "experts"):
            raise ValueError(f"lora.base_quantize={self.base_quantize!r} is not 'all' or 'experts'")
        try:
            re.compile(self.targets)
        except re.error as e:
            raise ValueError(f"lora.targets is not a valid regex ({e}): {self.targets!r}") from e

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def quantized(self) -> bool:
        return self.base_weights != "none"

    def load_kwargs(self) -> dict:
        """`load_pretrained` arguments of the base: quantized as `base_weights` says, or nothing."""
        return {"weights": self.base_weights, "quantize": self.base_quantize} if self.quantized else {}


class Adapter(nnx.Module):
    """A [*batch, *in, r] and B [*batch, r, *out] for a weight [*batch, *in, *out]."""

    def __init__(self, weight: nnx.Variable, contract: int, cfg: LoRAConfig, rngs: nnx.Rngs):
        axes = params.logical_axes(weight)
        nb = stack_dims(axes)  # leading layers / expert axes: each slice its own adapter
        shape = weight.shape
        dtype = jnp.float32 if isinstance(weight, QuantizedWeight) else weight.dtype  # QLoRA: fp32 adapters
        a_shape, b_shape = (*shape[:nb + contract], cfg.rank), (*shape[:nb], cfg.rank, *shape[nb + contract:])
        a = jax.random.normal(rngs.params(), a_shape, jnp.float32) / cfg.rank
        self.a = nnx.LoRAParam(a.astype(dtype), logical_axes=(*axes[:nb + contract], None))
        self.b = nnx.LoRAParam(jnp.zeros(b_shape, dtype), logical_axes=(*axes[:nb], None, *axes[nb + contract:]))
        self.scale, self.contract, self.dropout = cfg.scale, contract, cfg.dropout

    def delta(self) -> jax.Array:
        """s A B, the update in the weight's own shape (for merging and the absorbed MLA form).
        The batch axes are counted on the arrays: a scan over layers removes the leading one."""
        return low_rank_delta(self.a[...], self.b[...], self.a.ndim - self.contract - 1, self.scale, jnp)


def low_rank_delta(a, b, batch_rank: int, scale: float, xp=np):
    """scale * A B for A [*batch, *in, r], B [*batch, r, *out] -> [*batch, *in, *out] in fp32
    (`xp`: numpy for the exporter's host slices, jax.numpy in the model)."""
    lead, r = a.shape[:batch_rank], a.shape[-1]
    nl = int(np.prod(lead, dtype=np.int64))
    d = xp.einsum("Lir,Lro->Lio", a.reshape(nl, -1, r).astype(xp.float32), b.reshape(nl, r, -1).astype(xp.float32))
    return (scale * d).reshape(*lead, *a.shape[batch_rank:-1], *b.shape[batch_rank + 1:])


def adapter(module: nnx.Module, name: str) -> Adapter | None:
    return getattr(module, f"{name}_lora", None)


class DropoutKey(nnx.Variable):
    """Key data ([*layers, 2] uint32) of an adapter's dropout masks in one training step: put on by
    `with_dropout` inside the step, so never part of the stored model."""


def pair(module: nnx.Module, name: str):
    """(A, B, scale, dropout) of the adapter on `module.<name>`, or None: the `lora` argument of
    `project`; dropout is (rate, key data [2]) in a training step (`with_dropout`), else None."""
    ad = adapter(module, name)
    if ad is None:
        return None
    key = getattr(ad, "dropout_key", None)
    return ad.a[...], ad.b[...], ad.scale, None if key is None else (ad.dropout, key[...])


def with_dropout(model: nnx.Module, key_data: jax.Array) -> None:
    """Gives every adapter with dropout > 0 its keys for this step (in place): adapter i (in graph
    order) gets fold_in(key, i), split over its leading `layers` axes. `key_data` [2] uint32."""
    key = jax.random.wrap_key_data(key_data)
    for i, (_, node, name) in enumerate(_adapted(model)):
        ad = adapter(node, name)
        if ad.dropout:
            layers = ad.a.shape[:stack_dims(params.logical_axes(ad.a), (params.LAYERS,))]
            keys = jax.random.split(jax.random.fold_in(key, i), layers) if layers else jax.random.fold_in(key, i)
            ad.dropout_key = DropoutKey(jax.random.key_data(keys))


def weight(module: nnx.Module, name: str) -> jax.Array:
    """W, plus s A B where `name` carries an adapter: for uses that need the matrix itself (a
    quantized W dequantized: the sum in fp32)."""
    w, ad = getattr(module, name)[...], adapter(module, name)
    if ad is None:
        return w
    if isinstance(w, QArray):
        return quant.dequantize(w, jnp.float32) + ad.delta()
    return (w.astype(jnp.float32) + ad.delta()).astype(w.dtype)


def expert_adapters(moe: nnx.Module) -> tuple[tuple[jax.Array, ...], float, tuple | None]:
    """The routed experts' adapters: ((a1, b1, a3, b3, a2, b2), scale, dropout), or ((), 1.0, None)
    without. dropout: (rate, key data of w1's, w3's and w2's adapter) in a training step with
    dropout (`with_dropout`), else None: the `lora_dropout` of `ops.dispatch`."""
    ads = [adapter(moe, n) for n in ("w1", "w3", "w2")]
    if ads[0] is None:
        return (), 1.0, None
    keyed = getattr(ads[0], "dropout_key", None) is not None
    dropout = (ads[0].dropout, *(ad.dropout_key[...] for ad in ads)) if keyed else None
    return tuple(m[...] for ad in ads for m in (ad.a, ad.b)), ads[0].scale, dropout


def _targets(model: nnx.Module, cfg: LoRAConfig):
    """(path, module, weight name, contract) of every weight the config adapts."""
    pattern = re.compile(cfg.targets)
    for path, node, name, contract in params.projections(model):
        where = "/".join(path)
        routed = "expert" in params.logical_axes(getattr(node, name))
        if pattern.fullmatch(where) and (cfg.experts or not routed):
            yield where, node, name, contract


def apply(model: nnx.Module, cfg: LoRAConfig) -> list[str]:
    """Puts a fresh adapter on every target weight of `model` (in place); returns their paths."""
    rngs = nnx.Rngs(cfg.seed)
    found = list(_targets(model, cfg))
    if not found:
        raise ValueError(f"lora.targets={cfg.targets!r} (experts={cfg.experts}) matches no weight of the model")
    for _, node, name, contract in found:
        if adapter(node, name) is not None:
            raise ValueError(f"{name} already carries a LoRA adapter")
        setattr(node, f"{name}_lora", Adapter(getattr(node, name), contract, cfg, rngs))
    return [where for where, *_ in found]


def _adapted(model: nnx.Module):
    for path, node, name, _ in params.projections(model):
        if adapter(node, name) is not None:
            yield "/".join(path), node, name


class QuantizedBase(nnx.Variable):
    """The quantized weight a merge replaced (kept on the taken-off adapter for `unmerge`)."""


def merge(model: nnx.Module) -> dict[str, Adapter]:
    """W <- W + s A B for every adapter, which is taken off the model (now a plain base model of the
    same forward). A quantized W becomes the fp32 `nnx.Param` dequantize(W) + s A B. Returns the
    adapters by weight path, for `unmerge`."""
    taken = {}
    for where, node, name in list(_adapted(model)):
        ad, var = adapter(node, name), getattr(node, name)
        if isinstance(var, QuantizedWeight):
            ad.quantized_base = QuantizedBase(var[...], logical_axes=params.logical_axes(var))
            setattr(node, name, nnx.Param(weight(node, name), logical_axes=params.logical_axes(var)))
        else:
            var[...] = weight(node, name)
        taken[where] = ad
        delattr(node, f"{name}_lora")
    return taken


def unmerge(model: nnx.Module, adapters: dict[str, Adapter]) -> None:
    """Inverse of `merge`: W <- W - s A B and the adapters back in place."""
    nodes = {"/".join(str(p) for p in path): node for path, node in nnx.iter_graph(model)}
    for where, ad in adapters.items():
        owner, name = where.rsplit("/", 1)
        node = nodes[owner]
        w = getattr(node, name)
        base = getattr(ad, "quantized_base", None)
        if base is not None:  # the quantized weight as it was (not W + s A B - s A B requantized)
            setattr(node, name, QuantizedWeight(base[...], logical_axes=params.logical_axes(base)))
            del ad.quantized_base
        else:
            w[...] = (w[...].astype(jnp.float32) - ad.delta()).astype(w.dtype)
        setattr(node, f"{name}_lora", ad)

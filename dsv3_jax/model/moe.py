"""DeepSeekMoE: shared expert(s) plus routed experts chosen by the bias-corrected sigmoid router."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import lora, params
from dsv3_jax.model.mlp import MLP
from dsv3_jax.ops import dispatch, routing
from sharding import eplb, expert_parallel


class RouterStats(NamedTuple):
    expert_counts: jax.Array  # float32 [E]: valid tokens routed to each expert (for the bias update)
    balance_loss: jax.Array  # float32 []: sequence-wise balance loss before its weight alpha
    dropped_fraction: jax.Array  # float32 []: (token, expert) pairs past the expert-parallel capacity
    replica_counts: jax.Array | None = None  # float32 [P]: tokens per physical expert, with a placement


class ExpertReplicas(nnx.Variable):
    """An EPLB placement's logical -> physical expert map (int32 [E, R], -1 past an expert's
    replicas; sharding/eplb.py). Not an `nnx.Param`: placed, never trained."""


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.weight = params.normal(rngs, (cfg.num_routed_experts, cfg.hidden_size), ("expert", "embed"),
                                    std=cfg.initializer_range, dtype=cfg.param_dtype)
        self.bias = params.RouterBias(jnp.zeros((cfg.num_routed_experts,), jnp.float32), logical_axes=("expert",))

    def __call__(self, x_NxD: jax.Array) -> routing.Routing:
        """Router logits in fp32 (x W_g^T), then group-limited top-k."""
        cfg = self.cfg
        logits = jnp.einsum("ND,ED->NE", x_NxD.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        return routing.route(logits, self.bias[...], top_k=cfg.num_experts_per_token,
                             num_groups=cfg.num_expert_groups, groups_kept=cfg.num_groups_per_token,
                             routed_scale=cfg.routed_scaling_factor, normalize=cfg.norm_topk_prob)


class MoE(nnx.Module):
    LORA_TARGETS = {"w1": 1, "w3": 1, "w2": 1}  # routed experts' weights [E, ...]: contracted axes after E

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e, d, f, std, pd = (cfg.num_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                            cfg.initializer_range, cfg.param_dtype)
        self.gate = Router(cfg, rngs=rngs)
        self.w1 = params.normal(rngs, (e, d, f), ("expert", "embed", "mlp"), std=std, dtype=pd)
        self.w3 = params.normal(rngs, (e, d, f), ("expert", "embed", "mlp"), std=std, dtype=pd)
        self.w2 = params.normal(rngs, (e, f, d), ("expert", "mlp", "embed"), std=std, dtype=pd)
        if cfg.num_shared_experts:
            self.shared_experts = MLP(d, f * cfg.num_shared_experts, std=std, param_dtype=pd,
                                      compute_dtype=cfg.compute_dtype, rngs=rngs, fp8=cfg.fp8_matmul)
        else:
            self.shared_experts = None
        self.replicas = None  # ExpertReplicas once `place_experts` lays the experts out

    def __call__(self, x_BxTxD: jax.Array, token_mask_BxT: jax.Array | None = None, layer=None
                 ) -> tuple[jax.Array, RouterStats]:
        """x [B, T, D] -> (routed + shared output [B, T, D], router statistics).

        With `layer`, the routed experts' weights are the whole stack [L, E, ...] (inference over a
        scanned stack, `block.run_stack`) and are read in place at `layer`."""
        cfg, (b, t, d) = self.cfg, x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(b * t, d)
        route = self.gate(x_NxD)
        dt = cfg.compute_dtype
        physical = route if self.replicas is None else route._replace(
            experts_NxK=routing.to_replicas(route.experts_NxK, self.replicas[...]))
        y, dropped = self._routed(x_NxD.astype(dt), physical, layer)
        y = y.reshape(b, t, d)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_BxTxD)
        mask_N = None if token_mask_BxT is None else token_mask_BxT.reshape(-1)
        stats = RouterStats(routing.expert_counts(route.experts_NxK, cfg.num_routed_experts, mask_N),
                            routing.sequence_balance_loss(route, b, token_mask_BxT),
                            dropped / route.experts_NxK.size)
        if self.replicas is not None:
            stats = stats._replace(replica_counts=routing.expert_counts(physical.experts_NxK, self.w1.shape[-3],
                                                                        mask_N))
        return y, stats

    def _routed(self, x_NxD: jax.Array, route: routing.Routing, layer=None) -> tuple[jax.Array, jax.Array]:
        """Routed experts: all-to-all expert parallelism when the context mesh (`jax.set_mesh`)
        splits experts over `expert`, else the single-device dispatch on each device's tokens.
        Same function when dropless. Returns (y [N, D], float32 [] dropped (token, expert) pairs).
        LoRA adapters on the routed experts ([E, ...] per layer) travel with the expert weights."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        mesh = jax.sharding.get_abstract_mesh()
        stacks = (self.w1[...], self.w3[...], self.w2[...])
        adapters, scale, drop = lora.expert_adapters(self)  # drop: a training step's adapter dropout, or None
        adapters = tuple(a.astype(dt) for a in adapters)
        scaled = {"lora_scale": scale, "impl": cfg.moe_impl, "fp8": cfg.fp8_matmul, "max_tile": cfg.moe_tile_size}
        split_experts, split_tokens = expert_parallel.is_active(mesh), expert_parallel.splits_tokens(mesh)
        if drop is not None and (split_experts or split_tokens):
            raise ValueError("lora.dropout > 0 with lora.experts=True runs on single-device expert dispatch only "
                             "(masks are drawn over one device's sorted rows); set lora.dropout=0, lora.experts=False "
                             "or a mesh without expert/token splitting")
        if not split_experts and not split_tokens:  # a layer stack is read in place at `layer`
            ws = stacks if layer is not None else tuple(w.astype(dt) for w in stacks)
            return dispatch.routed_experts(x_NxD, route.experts_NxK, route.weights_NxK, *ws, *adapters, layer=layer,
                                           lora_dropout=drop, **scaled), jnp.float32(0)
        weights = tuple((w if layer is None else w[layer]).astype(dt) for w in stacks) + adapters
        if split_experts:
            local = functools.partial(dispatch.local_expert_mlp, **scaled)
            y, dropped = expert_parallel.expert_parallel(
                x_NxD, route.experts_NxK, route.weights_NxK, weights, local, mesh=mesh,
                num_experts=self.w1.shape[-3], capacity_factor=cfg.expert_capacity_factor,
                exchange=cfg.expert_exchange)
            return y, dropped.astype(jnp.float32)
        dispatch_fn = functools.partial(dispatch.routed_experts, **scaled)  # each device sorts its own tokens only
        return expert_parallel.token_parallel(x_NxD, route.experts_NxK, route.weights_NxK, weights, dispatch_fn,
                                              mesh=mesh), jnp.float32(0)


def place_experts(moe: MoE, placement: eplb.Placement) -> None:
    """Lays a layer stack's routed experts [L, E, ...] out as `placement`'s physical experts
    [L, P, ...], a redundant expert's weights a copy of its logical expert's, and keeps the
    logical -> physical map in the model state (`moe.replicas`), so each routed token goes to one
    replica (`routing.to_replicas`) and the map is saved and sharded with the weights. Every array
    keeps its sharding's spec: the P physical experts split over `expert` as the E logical ones did."""
    layers, experts = placement.replica_count.shape
    if moe.replicas is not None:
        raise ValueError("the routed experts are placed already; place them once, from the logical layout")
    if lora.expert_adapters(moe)[0]:
        raise ValueError("expert placement needs routed experts without LoRA adapters: merge the adapters first")
    if tuple(moe.w1.shape[:2]) != (layers, experts):
        raise ValueError(f"the expert placement is for {layers} MoE layers x {experts} experts; the model has "
                         f"{moe.w1.shape[0]} x {moe.w1.shape[1]}")
    take = (np.arange(layers)[:, None], placement.physical_to_logical)
    for name in ("w1", "w3", "w2"):
        var = getattr(moe, name)
        var.set_value(jax.tree.map(lambda a: _placed(a, take), var.get_value()))
    sharding = jax.tree.leaves(moe.w1.get_value())[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):  # the map is small: every device holds it whole
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    moe.replicas = nnx.data(ExpertReplicas(jax.device_put(placement.logical_to_physical, sharding),
                                           logical_axes=(params.LAYERS, None, None)))


def _placed(stack_LxE: jax.Array, take) -> jax.Array:
    """stack[take] ([L, E, ...] -> [L, P, ...]) in the stack's own sharding."""
    sharding, physical = stack_LxE.sharding, take[1].shape[1]
    if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) > 1 and sharding.spec[1]:
        axes = sharding.spec[1] if isinstance(sharding.spec[1], tuple) else (sharding.spec[1],)
        split = int(np.prod([sharding.mesh.shape[a] for a in axes]))
        if physical % split:
            raise ValueError(f"{physical} physical experts (experts + redundant_experts) do not split over the "
                             f"mesh axes {axes} ({split} devices): pick redundant_experts so that they do")
    return jax.device_put(stack_LxE[take], sharding)

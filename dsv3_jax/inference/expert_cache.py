"""Routed experts offloaded to host memory behind a device cache of C experts per MoE layer.

Letters: L MoE layers, E routed experts, S device slots per layer (C, up to S_max while one step
needs more), N tokens, K experts per token, W prefill chunk, B rows, M MTP drafts.

The host store holds every routed expert of the MoE stack, one pytree per (layer, expert): numpy
views of the stacks as they lie in host memory, so no second copy. `load_pretrained(...,
offload_experts=True)` builds them there at load (the CPU backend's device, `load.host_sharding`),
never on the accelerator; a model whose experts are still on its device (built in memory, or
loaded without it) is copied to the host once here. That memory is pageable: a host -> device
copy of an expert stages through a pinned buffer, where pinned (page-locked) memory would be read
by the device's DMA directly but would have to hold a second copy of every expert. The device
holds slots [L, S, ...] of the same weights (float or quantized: a `QArray` is sliced and written
leaf by leaf) and a logical -> slot map [L, E, 1], installed as the MoE's EPLB replica
map (`model.moe.ExpertReplicas`), whose physical experts are here the slots: the MoE routes as
always, `routing.to_replicas` sends each (token, expert) row to its slot, and an expert that is not
resident maps to slot S, which sorts after every slot in no group, so it adds nothing. The model
and the inference core's steps are unchanged; the offload wraps the compiled steps.

Why a checked rerun rather than a layer loop on the host or an `io_callback`: a step runs as it is
compiled; its router statistics name the experts each MoE layer's valid tokens chose. If all were
resident, the step was exact (the model with every expert resident). Otherwise the first layer with
a missing expert routed from an exact input, so its choice is final: those experts are loaded (LRU
or LFU eviction among the experts this step does not need there) and the step runs again on the
cache it returned, whose entries at the step's positions it rewrites (tokens read only the slots
before their positions). The later layers of that pass routed from a hidden state that lacks only
the missing experts' outputs: with `prefetch` their choices are loaded before the rerun, a
predictor from this step's own routing. So a step costs at most L_moe + 1 passes, every pass is one
of the same compiled programs (one per slot count S: S grows, in doublings of C, for a step whose
working set in some layer exceeds C, then shrinks back), and the answer is exact whatever the
weights' format. An `io_callback` would return a fixed-shape transfer per layer and
step, hits included; a layer loop on the host would be a second forward.

A step needs its working set resident at once: a prefill chunk of W tokens over B rows may need
up to min(W B K, E) experts in a layer, a decode step of B rows and 1 + M tokens each up to
min(B (1 + M) K, E). So the device holds C slots per layer, and up to S_max = the doubling of C
that covers min(E, K max(W B, B (1 + M))) during a step whose working set exceeds C: `wrap` takes
the steps' most tokens and sets it (`max_slots`), the warm-up compiles C .. S_max, and a step never
grows past it. A small prefill chunk keeps the device's share small (W = C // K for one row keeps a
prefill within C); with W B K >= E a step may hold the whole routed stack for its duration. The
MTP depths' experts stay resident (one layer each).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv3_jax.inference.steps import Steps
from dsv3_jax.model import lora, params
from dsv3_jax.model.moe import ExpertReplicas

POLICIES = ("lru", "lfu")
ROUTED = ("w1", "w3", "w2")


@dataclasses.dataclass
class CacheStats:
    steps: int = 0  # compiled steps served (prefill chunks and decode steps)
    passes: int = 0  # runs of those steps, reruns after a miss included
    lookups: int = 0  # (layer, expert) pairs the steps' valid tokens chose, each once per step
    misses: int = 0  # of those, loaded on demand (not resident, not prefetched, when the step began)
    loaded: int = 0  # experts copied host -> device: misses, prefetches and nothing else
    bytes_moved: int = 0
    stall_seconds: float = 0.0  # passes that were rerun, loads and shrinks

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.lookups if self.lookups else 0.0

    def reset(self) -> None:
        """Every counter back to zero, in place: the server's `Metrics` holds this object."""
        self.__dict__.update(dataclasses.asdict(CacheStats()))


@functools.partial(jax.jit, donate_argnums=0)
def _write(slots, expert, layer, slot):
    """slots[layer, slot] = expert, leaf by leaf."""
    def put(a_LxSx, x):
        return jax.lax.dynamic_update_slice(a_LxSx, x[None, None].astype(a_LxSx.dtype), (layer, slot) + (0,) * (x.ndim))
    return jax.tree.map(put, slots, expert)


@jax.jit
def _gather(slots, index_LxS):
    """slots[l, index[l, s]]: the slot arrays resized or reordered."""
    layers = jnp.arange(index_LxS.shape[0])[:, None]
    return jax.tree.map(lambda a: a[layers, index_LxS], slots)


class ExpertOffload:
    """Moves `model`'s routed MoE experts to the host and keeps `cache_size` of them per layer on the
    device (module docstring); `wrap` makes the inference core's steps use it. `policy`: "lru" or
    "lfu" (ties by recency) eviction; `prefetch`: load the later layers' predicted experts with a miss."""

    def __init__(self, model, cache_size: int, *, policy: str = "lru", prefetch: bool = True):
        cfg = model.config
        if model.moe_layers is None:
            raise ValueError("offload_experts: the model has no MoE layers")
        moe = model.moe_layers.ffn
        e, k = cfg.num_routed_experts, cfg.num_experts_per_token
        if not k <= cache_size <= e:
            raise ValueError(f"expert_cache={cache_size} must lie in [num_experts_per_token={k}, "
                             f"num_routed_experts={e}]: a token needs its top-k experts resident at once")
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy {policy!r}: expected one of {POLICIES}")
        if moe.replicas is not None:
            raise ValueError("offload_experts does not combine with an expert placement (redundant experts)")
        if lora.expert_adapters(moe)[0]:
            raise ValueError("offload_experts needs routed experts without LoRA adapters: merge the adapters first")
        devices = moe.gate.weight.get_value().sharding.device_set  # where the model computes
        if len(devices) != 1:
            raise ValueError(f"offload_experts runs on one device; the model lies on {len(devices)} (drop --mesh)")
        self.device = jax.sharding.SingleDeviceSharding(*devices)
        self.moe, self.policy, self.prefetch = moe, policy, prefetch
        self.capacity, self.num_layers, self.num_experts, self.top_k = cache_size, cfg.num_moe_layers, e, k
        self.max_slots = cache_size  # the most slots a step may grow to: set by `wrap`
        host = jax.device_get(tuple(getattr(moe, name).get_value() for name in ROUTED))  # views of host arrays
        self.store = [[jax.tree.map(lambda a: a[l, x], host) for x in range(e)] for l in range(self.num_layers)]
        self.expert_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(self.store[0][0]))
        self.stats = CacheStats()
        # the expert each slot holds, -1: none; the slots start with experts 0 .. C - 1, as `_slots` do
        self.expert_in = np.tile(np.arange(cache_size, dtype=np.int32), (self.num_layers, 1))
        self.last_used = np.zeros((self.num_layers, e), np.int64)
        self.uses = np.zeros((self.num_layers, e), np.int64)
        self._tick = 0
        self._slots = jax.device_put(jax.tree.map(lambda a: a[:, :cache_size], host), self.device)
        moe.replicas = nnx.data(ExpertReplicas(self._device_map(), logical_axes=(params.LAYERS, None, None)))
        self._install()

    @property
    def slot_of(self) -> np.ndarray:
        """int32 [L, E]: each expert's slot, -1 for one on the host only (the inverse of `expert_in`)."""
        out = np.full((self.num_layers, self.num_experts), -1, np.int32)
        layers, slots = np.nonzero(self.expert_in >= 0)
        out[layers, self.expert_in[layers, slots]] = slots
        return out

    # -- the device side ---------------------------------------------------------------------
    def _device_map(self) -> jax.Array:
        """int32 [L, E, 1]: each expert's slot, or S (no group) when it is not resident."""
        slot_of = self.slot_of
        return jax.device_put(np.where(slot_of >= 0, slot_of, self.expert_in.shape[1])[..., None], self.device)

    def _install(self) -> None:
        """The slots and the map into the model's variables (every state split from it shares them)."""
        for name, value in zip(ROUTED, self._slots):
            getattr(self.moe, name).set_value(value)
        self.moe.replicas.set_value(self._device_map())

    def _load(self, layer: int, expert: int, slot: int) -> None:
        self._slots = _write(self._slots, jax.device_put(self.store[layer][expert], self.device), np.int32(layer),
                             np.int32(slot))
        self.expert_in[layer, slot] = expert
        self.last_used[layer, expert] = self._tick
        self.stats.loaded += 1
        self.stats.bytes_moved += self.expert_bytes

    def _resize(self, index_LxS: np.ndarray) -> None:
        """Slot s of layer l takes what slot index[l, s] held (-1: nothing)."""
        self._slots = _gather(self._slots, jnp.asarray(np.maximum(index_LxS, 0)))
        held = np.take_along_axis(self.expert_in, np.maximum(index_LxS, 0), axis=1)
        self.expert_in = np.where(index_LxS >= 0, held, -1).astype(np.int32)

    # -- the host side -----------------------------------------------------------------------
    def _victim(self, layer: int, keep_E: np.ndarray) -> int | None:
        """A slot for a new expert in `layer`: an empty one, else the policy's choice among the
        resident experts not in `keep_E`; None when all are kept."""
        held = self.expert_in[layer]
        if (held < 0).any():
            return int(np.argmax(held < 0))
        free = np.flatnonzero(~keep_E[held])
        if not free.size:
            return None
        experts = held[free]
        order = (np.argsort(self.last_used[layer, experts], kind="stable") if self.policy == "lru"
                 else np.lexsort((self.last_used[layer, experts], self.uses[layer, experts])))
        return int(free[order[0]])

    def _covering(self, need: int) -> int:
        """The slots a step needing `need` experts in a layer runs with: C doubled until it covers them, at most E."""
        doublings = int(np.ceil(np.log2(max(need, self.capacity) / self.capacity)))
        return min(self.num_experts, self.capacity * 2 ** doublings)

    def _grow(self, need: int) -> None:
        size, new = self.expert_in.shape[1], self._covering(need)
        if new > self.max_slots:
            raise RuntimeError(f"a step needs {need} experts in a MoE layer, more than the {self.max_slots} slots "
                               f"its tokens bound (wrap's `tokens`)")
        index = np.concatenate([np.arange(size), np.full(new - size, -1)])
        self._resize(np.broadcast_to(index, (self.num_layers, new)))

    def _shrink(self, need_LxE: np.ndarray, size: int) -> None:
        """Down to `size` slots per layer: this step's experts first, then by the policy."""
        held = self.expert_in
        experts = np.maximum(held, 0)
        rank = np.take_along_axis(need_LxE, experts, 1).astype(np.int64) << 62
        rank += np.take_along_axis(self.last_used if self.policy == "lru" else self.uses, experts, 1)
        rank = np.where(held >= 0, rank, -1)
        self._resize(np.argsort(-rank, axis=1, kind="stable")[:, :size])

    def _serve(self, need_LxE: np.ndarray, demanded_LxE: np.ndarray) -> bool:
        """True if every needed expert is resident; else loads the first missing layer's (and, with
        prefetch, the later layers' predicted) experts for a rerun."""
        missing = need_LxE & (self.slot_of < 0)
        if not missing.any():
            return True
        first = int(np.argmax(missing.any(axis=1)))
        if need_LxE[first].sum() > self.expert_in.shape[1]:
            self._grow(int(need_LxE[first].sum()))
        for expert in np.flatnonzero(missing[first]):
            self._load(first, int(expert), self._victim(first, need_LxE[first]))
            demanded_LxE[first, expert] = True
        for layer in range(first + 1, self.num_layers) if self.prefetch else ():
            for expert in np.flatnonzero(missing[layer]):
                slot = self._victim(layer, need_LxE[layer])
                if slot is None:
                    break
                self._load(layer, int(expert), slot)
        self._install()
        return False

    def _run(self, step, needed, *args):
        """`step(*args)` until every expert its valid tokens chose was resident; its last output. The
        slots are back at the count the step began with (C but in a warm-up) however it ends."""
        state = args[0]  # shares the model's variables, which the loads replace
        cache, *rest = jax.device_put(args[1:], self.device)  # committed, as a rerun gets them: one compile
        start, size = time.perf_counter(), self.expert_in.shape[1]
        demanded = np.zeros((self.num_layers, self.num_experts), bool)
        need = np.zeros_like(demanded)
        self._tick += 1
        try:
            for _ in range(2 * self.num_layers + 2):
                began = time.perf_counter()
                out, cache = step(state, cache, *rest)
                need = needed(out) > 0.5
                self.stats.passes += 1
                if self._serve(need, demanded):
                    break
            else:
                raise RuntimeError("the expert cache did not converge: the routing changed between identical passes")
            self.stats.steps += 1
            self.stats.lookups += int(need.sum())
            self.stats.misses += int((demanded & need).sum())
            self.last_used[need] = self._tick
            self.uses += need
        finally:
            shrink = time.perf_counter()
            if self.expert_in.shape[1] > size:
                self._shrink(need, size)
                self._install()
        self.stats.stall_seconds += began - start + time.perf_counter() - shrink
        return out, cache

    def warm_up(self, compile_steps) -> None:
        """Calls `compile_steps()` at each slot count a step may grow to (C, 2C, .. `max_slots`), the
        slots grown to it, so that every step the cache runs is compiled; then back to C slots, the
        counters cleared."""
        try:
            compile_steps()
            while self.expert_in.shape[1] < self.max_slots:
                self._grow(self.expert_in.shape[1] + 1)
                self._install()
                compile_steps()
        finally:
            self._shrink(np.zeros((self.num_layers, self.num_experts), bool), self.capacity)
            self._install()
            self.stats.reset()

    def wrap(self, steps: Steps, tokens: int) -> Steps:
        """The compiled steps run through the cache (same arguments and results). `tokens`: the most
        valid tokens one step runs (a prefill chunk's over its rows, a decode step's rows x (1 + drafts)),
        which bound the slots a step may grow to: `max_slots` (module docstring)."""
        self.max_slots = self._covering(min(self.num_experts, self.top_k * tokens))

        def prefill(*args):  # (state, cache, rows, window, start, lengths, carry, ...): the carry sums the chunks'
            before = np.asarray(args[6].expert_counts)
            return self._run(steps.prefill, lambda out: np.asarray(out[0].expert_counts) - before, *args)

        def decode(*args):
            return self._run(steps.decode, lambda out: np.asarray(out.expert_counts), *args)

        return Steps(prefill, decode, steps.traces)

"""Plans a serving deployment before booking it: bytes per device, whether it fits a chip, and
the decode step lowered for the mesh.

    python -m experiments.plan_serving --model=deepseek_v3 --weights=fp8 --cache_dtype=bfloat16 \
        --chip=h200 --mesh=expert=8 --max_batch=64 --context=32768 [--platforms=cuda,tpu] [--use_mtp]
    python -m experiments.plan_serving --table      # the README's 671B deployments
    python -m experiments.plan_serving --offload [--host_link_gbps=64]   # 671B int4, routed experts in host RAM
    python -m experiments.plan_serving --page_size=128 --mix=512:0.9,32768:0.1 [--table]   # a paged cache

Nothing is allocated: the model is its shapes (`nnx.eval_shape`), the mesh a
`jax.sharding.AbstractMesh`, and the server's own decode step (`dsv3_jax/serving/runner.py`, the
step `experiments.serve --mesh --weights` runs, with the weights held in the deployment's format) is
traced and lowered for each platform, which checks every sharding and shape on that mesh.

Per device (GB = 1e9 bytes):
- weights: each parameter's shard (`sharding/rules.py`, the table `load_pretrained(mesh=...)`
  places by) in the weight format. Formats: `fp32` (the CPU checks), `bf16`; `fp8` (every linear weight e4m3 with one fp32
  scale per 128 x 128 block, as DeepSeek's release; embedding, head, norms and router in bf16);
  `int8` / `int4` (every linear weight, one fp32 scale per group of `--group` weights along the
  contraction axis, int4 two per byte); `int8_experts` / `int4_experts` (the routed experts only,
  the rest bf16). These are formulas on the parameter shapes, not read from a quantized model.
- latent cache: `dsv3_jax/inference/cache.py`'s bytes per token and layer x layers (+ the MTP
  depths with --use_mtp) x the device's slots (max_batch over data x fsdp x expert, the runner's
  split) x context. MLA's latent is shared by all heads, so `tensor` does not split it.
- working set of the largest decode step (every slot, K = 1 + drafts tokens each): fp32 logits of
  the device's rows over the vocabulary shard, x 3 (logits, penalised, log-softmax); attention
  scores and probabilities in fp32 over the device's heads and the context (a V3.2 model: over
  index_topk entries, plus the indexer's scores over the context and the gathered latent rows); one MoE layer's local
  routed experts in the compute dtype, whole along `mlp` (`expert_parallel` takes them so; counted
  in the compute dtype whatever the stored format: a dequantising kernel needs less); the
  expert-parallel exchange (`experiments/plan_memory.py`'s dropless receive rows, 6 x [R, D] and
  3 x [R, F]). Not counted: a smaller bucket's copy of its slots' cache rows (the runner gathers
  them; at most the largest bucket below max_batch over max_batch of the cache).

A plan fits a chip when the total stays under `--headroom` (default 0.9) of its HBM. The largest
batch for each context is the largest multiple of the token shards that fits.

`--check_compiled` also compiles the decode step for this host's devices (the mesh must use them
all, e.g. 8 fake CPU devices; fp32/bf16 weights: the check is of the activations and the cache, and
XLA:CPU would widen quantized weights)
and prints XLA's per-device memory_analysis() beside the plan. Use fp32 there: XLA:CPU computes
bf16 in fp32 and holds fp32 copies of a bf16 cache, which no TPU or GPU program does.

`--page_size=K` plans a paged cache (`experiments.serve --page_size`): the cache is pages of K
tokens that requests hold for what they have, so what fits is a count of concurrent requests of a
length mix (`--mix`: lengths, prompt + new tokens, and their shares). A request of length l holds
ceil(l / K) pages; the device's requests (split over data x fsdp x expert, as the slots) hold
ceil(their count x the mix's mean pages a request) pages, bytes per token and layer x layers x K
each. The working set is the one above, its attention over the mix's mean length a row instead of
the context. Beside it, the slot cache's count: slots of the mix's longest request. No step is
lowered in this mode.

`--offload` plans the 671B int4 deployments whose routed experts live in host RAM behind a device
cache of C experts per MoE layer (`dsv3_jax/inference/expert_cache.py`). Per deployment: the bytes
that stay on the devices (the plan above without the MoE stack's routed experts), the largest C
whose slots [L_moe, C] (stored format) and one layer's C experts in the compute dtype fit beside
them in `headroom` of HBM, the host RAM the experts take (the offloaded model loads them straight
there), and the tokens/s the host link bounds at a hit rate h: a decode step of one row without
MTP looks up K experts per MoE layer, so it moves L_moe K (1 - h) experts per token, and tokens/s
<= devices x link bytes/s / those bytes, an upper bound from the link alone. The expert cache runs
on one device, so a row of more devices is a plan, not a command that runs today. Google's Cloud
TPU pages give no host-link bandwidth per chip: a TPU plan takes it from --host_link_gbps.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

import sharding
from dsv3_jax import DeepSeekV3, ModelConfig, cli
from dsv3_jax.inference.cache import CACHE_DTYPES, cache_bytes_per_token, init_cache
from dsv3_jax.inference.sampling import RowSampling
from dsv3_jax.model import quant as quant_model
from dsv3_jax.model.params import logical_axes
from sharding.rules import key_name
from dsv3_jax.serving import runner as runner_lib
from dsv3_jax.serving.penalties import table_width
from experiments import plan_memory

GB = 1e9
WEIGHTS = ("fp32", "bf16", "fp8", "int8", "int8_experts", "int4", "int4_experts")
CONTEXTS = (8192, 32768, 131072)


class Chip(NamedTuple):
    name: str
    hbm_bytes: float
    platform: str  # what its programs are lowered for
    source: str
    host_link_bytes: float | None = None  # host -> device bytes/s of one device's link (None: no public figure)


CHIPS = {c.name.lower(): c for c in (
    Chip("H100", 80e9, "cuda", "NVIDIA H100 Tensor Core GPU data sheet: SXM5, 80 GB HBM3; PCIe Gen5 x16, "
         "128 GB/s both directions", 64e9),
    Chip("H200", 141e9, "cuda", "NVIDIA H200 Tensor Core GPU data sheet: 141 GB HBM3e; PCIe Gen5 x16, "
         "128 GB/s both directions", 64e9),
    Chip("B200", 180e9, "cuda", "NVIDIA DGX B200 data sheet: 1,440 GB HBM3e over 8 GPUs"),
    Chip("v5e", 16e9, "tpu", "Google Cloud TPU v5e documentation: 16 GB HBM2 per chip"),
    Chip("v5p", 95e9, "tpu", "Google Cloud TPU v5p documentation: 95 GB HBM2e per chip"),
    Chip("v6e", 32e9, "tpu", "Google Cloud TPU v6e (Trillium) documentation: 32 GB HBM per chip"),
    Chip("v7x", 192e9, "tpu", "Google Cloud TPU7x (Ironwood) documentation: 192 GB HBM3e per chip"),
)}


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One serving plan: the model, its formats, the mesh and the slots."""

    chip: str
    mesh: dict  # axis -> size (sharding.AXES)
    weights: str = "bf16"
    cache_dtype: str = "bfloat16"
    max_batch: int = 16
    context: int = 4096
    use_mtp: bool = False
    rules: str = "default"
    group: int = 128  # int8/int4 group along the contraction axis
    page_size: int | None = None  # a paged cache: requests of `mix` hold pages of this many tokens
    mix: tuple = ()  # ((length, share), ...): the requests' lengths and their shares (Fractions summing to 1)

    def __post_init__(self):
        if self.page_size is not None and (self.page_size < 1 or not self.mix or sum(w for _, w in self.mix) != 1
                                           or any(not 1 <= n <= self.context or w <= 0 for n, w in self.mix)):
            mix = ",".join(f"{n}:{float(w):g}" for n, w in self.mix)
            raise ValueError(f"--page_size={self.page_size} needs a --mix of lengths in [1, --context={self.context}]"
                             f" with positive shares summing to 1, got {mix}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"--weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"--cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}")
        if self.chip.lower() not in CHIPS:
            raise ValueError(f"--chip {self.chip!r} is not in the table: {', '.join(c.name for c in CHIPS.values())}")


def _matrix_split(path: tuple[str, ...], axes: tuple) -> tuple[int, int] | None:
    """(first, last) dims of a linear weight's contraction axes, or None for what no format quantizes
    (embedding, head, norms, router, MTP's eh_proj: `dsv3_jax/model/quant.py`). Stacked leading dims (`layers`, `expert`) come first."""
    name = ".".join(path)
    if len(axes) < 2 or name in ("embed", "head") or ".gate." in name or name.endswith((".weight", "eh_proj")):
        return None
    first = sum(a in ("layers", "expert") for a in axes[:2])
    if len(axes) - first < 2:
        return None
    return first, first + (2 if axes[first] == "heads" else 1)  # wo contracts heads x head_dim


def quantized_bytes(shape: tuple[int, ...], split: tuple[int, int] | None, routed: bool, weights: str,
                    group: int) -> float:
    """Bytes of one (per-device) block of a parameter in the weight format (module docstring);
    `routed`: a routed experts' stack."""
    n = math.prod(shape)
    if weights == "fp32":
        return 4.0 * n
    if split is None or weights == "bf16" or (weights.endswith("_experts") and not routed):
        return 2.0 * n
    first, last = split
    contract = math.prod(shape[first:last])
    rows = n // contract
    if weights == "fp8":
        out = n // math.prod(shape[:last])  # the 128 x 128 block grid over (contraction, output)
        return n + 4.0 * math.prod(shape[:first]) * math.ceil(contract / 128) * math.ceil(out / 128)
    bits = 8 if weights.startswith("int8") else 4
    return n * bits / 8 + 4.0 * rows * math.ceil(contract / group)


# --weights -> (format, projections) of `dsv3_jax/model/quant.py` for the model whose decode step is lowered
QUANTIZED = {"fp8": ("fp8", "all"), "int8": ("int8", "all"), "int4": ("int4", "all"),
             "int8_experts": ("int8", "experts"), "int4_experts": ("int4", "experts")}


def abstract_model(cfg: ModelConfig, weights: str = "bf16", group: int = 128):
    """The model as shapes, its projections held in `weights`' format (QArray leaves: the decode
    step lowered is the one `experiments.serve --weights` runs)."""
    if weights not in QUANTIZED:
        return nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    fmt, which = QUANTIZED[weights]
    return nnx.eval_shape(lambda: quant_model.quantize_model(DeepSeekV3(cfg, rngs=nnx.Rngs(0)), fmt, which, group))


def _leaf_shardings(model, mesh, table) -> dict:
    """{state leaf path: NamedSharding}: each parameter by its logical axes; a quantized one's q and
    scale by theirs (`quant.physical_axes`), as `load_pretrained(mesh=...)` places them."""
    where = {}
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        path, axes = tuple(str(p) for p in path), logical_axes(var)
        if isinstance(var, quant_model.QuantizedWeight):
            qa = var[...]
            q_axes, s_axes = quant_model.physical_axes(axes, qa.fmt, qa.contract)
            where[path + ("q",)] = sharding.named_sharding(q_axes, qa.q.shape, mesh, table)
            where[path + ("scale",)] = sharding.named_sharding(s_axes, qa.scale.shape, mesh, table)
        else:
            where[path] = sharding.named_sharding(axes, var.shape, mesh, table)
    return where


def weight_bytes(model, mesh, dep: Deployment) -> float:
    """Bytes of the weights on the device holding the most."""
    table = sharding.get_rules(dep.rules)
    total = 0.0
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        path = tuple(str(p) for p in path)
        axes = logical_axes(var)
        spec = sharding.logical_to_spec(axes, var.shape, mesh, table, name=".".join(path))
        shard = jax.sharding.NamedSharding(mesh, spec).shard_shape(tuple(var.shape))
        if var.dtype == jnp.float32 and len(shard) <= 2 and "bias" in path[-1]:
            total += 4.0 * math.prod(shard)  # the router's fp32 bias
        else:
            routed = "expert" in axes and _matrix_split(path, axes) is not None
            total += quantized_bytes(shard, _matrix_split(path, axes), routed, dep.weights, dep.group)
    return total


def mix_pages(mix, page_size: int) -> fractions.Fraction:
    """Pages a request of the length mix holds at its end, on average: sum_i share_i ceil(length_i / K)."""
    return sum(w * -(-n // page_size) for n, w in mix)


def mix_tokens(mix) -> fractions.Fraction:
    """Tokens of a request of the length mix, on average."""
    return sum(w * n for n, w in mix)


def cache_bytes(cfg: ModelConfig, mesh, dep: Deployment, batch: int, context: int) -> float:
    """Per device: its slots x context tokens, or (paged) the pages of its requests of the mix."""
    layers = cfg.num_layers + (cfg.num_mtp_layers if dep.use_mtp else 0)
    per_token = cache_bytes_per_token(cfg, dep.cache_dtype) * layers
    rows = batch // runner_lib.token_shards(mesh)
    if dep.page_size is None:
        return float(per_token * rows * context)
    return float(per_token * dep.page_size * math.ceil(rows * mix_pages(dep.mix, dep.page_size)))


def working_bytes(cfg: ModelConfig, mesh, dep: Deployment, batch: int, context: int, platform: str) -> dict:
    """The largest decode step's temporaries per device (module docstring), by part."""
    shape = {a: mesh.shape.get(a, 1) for a in sharding.AXES}
    k = 1 + (cfg.num_mtp_layers if dep.use_mtp else 0)
    rows = batch // runner_lib.token_shards(mesh) * k  # this device's tokens
    t, p = shape["tensor"], shape["expert"]
    cb = jnp.dtype(cfg.compute_dtype).itemsize
    heads = cfg.num_heads // t if cfg.num_heads % t == 0 else cfg.num_heads
    vocab = cfg.vocab_size // t if cfg.vocab_size % t == 0 else cfg.vocab_size
    local = cfg.num_routed_experts // p
    received = plan_memory.received_rows(cfg, rows, p, cfg.expert_capacity_factor)
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    attended = min(context, cfg.index_topk) if cfg.has_indexer else context  # DSA: each query's top-k only
    parts = {"logits (fp32, x 3)": 3.0 * 4 * rows * vocab,
             "attention scores (fp32, x 2)": 2.0 * 4 * rows * heads * attended}
    if cfg.has_indexer:
        parts["indexer scores (fp32) and gathered latent rows"] = 4.0 * rows * (
            context + attended * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))
    if cfg.num_moe_layers:
        parts["one MoE layer's local experts (compute dtype)"] = 3.0 * cb * local * d * f
        parts["expert exchange and hidden rows"] = float(cb * received * (6 * d + 3 * f))
    return parts


class Plan(NamedTuple):
    weights: float
    cache: float
    working: dict
    hbm: float
    headroom: float

    @property
    def total(self) -> float:
        return self.weights + self.cache + sum(self.working.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.headroom * self.hbm


def plan(cfg: ModelConfig, dep: Deployment, *, headroom: float = 0.9, mesh=None, model=None,
         batch: int | None = None, context: int | None = None) -> Plan:
    mesh = mesh if mesh is not None else sharding.abstract_mesh(dep.mesh, math.prod(dep.mesh.values()))
    model = model if model is not None else abstract_model(cfg)
    chip = CHIPS[dep.chip.lower()]
    batch, context = batch or dep.max_batch, context or dep.context
    return Plan(weight_bytes(model, mesh, dep), cache_bytes(cfg, mesh, dep, batch, context),
                working_bytes(cfg, mesh, dep, batch, context, chip.platform), chip.hbm_bytes, headroom)


def largest_batch(cfg: ModelConfig, dep: Deployment, context: int, *, headroom: float = 0.9, mesh=None,
                  model=None) -> int:
    """The largest multiple of the token shards whose plan at `context` fits (0 if none)."""
    mesh = mesh if mesh is not None else sharding.abstract_mesh(dep.mesh, math.prod(dep.mesh.values()))
    model = model if model is not None else abstract_model(cfg)
    step = runner_lib.token_shards(mesh)
    fits = lambda b: plan(cfg, dep, headroom=headroom, mesh=mesh, model=model, batch=b, context=context).fits
    if not fits(step):
        return 0
    lo, hi = 1, 2
    while fits(hi * step) and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo * step), not fits(hi * step)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def decode_step_args(cfg: ModelConfig, model, mesh, dep: Deployment, rules=None):
    """(jitted decode step of the runner, its arguments as ShapeDtypeStructs on `mesh`): every slot."""
    graphdef, state = nnx.split(model)
    table = sharding.get_rules(rules or dep.rules)
    where = _leaf_shardings(model, mesh, table)
    state_sds = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where[_path(path)]), state)
    drafts = cfg.num_mtp_layers if dep.use_mtp else 0
    cache_sh = runner_lib.cache_sharding(mesh, dep.max_batch, table)
    cache = jax.eval_shape(lambda: init_cache(cfg, dep.max_batch, dep.context, dep.cache_dtype, with_mtp=drafts > 0))
    cache_sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cache_sh), cache)
    b = dep.max_batch
    host = lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype,
                                          sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    sampling = jax.tree.map(host, RowSampling.greedy(b, table_width(dep.context - drafts)))
    args = (state_sds, cache_sds, host(np.arange(b, dtype=np.int32)), host(np.zeros((b, 1 + drafts), np.int32)),
            host(np.zeros(b, np.int32)), host(np.zeros(b, bool)), sampling, None, None,
            host(np.zeros((b, 1 + drafts, -(-cfg.vocab_size // 32)), np.int32)))  # the grammar bitmask
    opts = runner_lib.steps.StepOptions(dep.use_mtp, logprobs=True)  # the runner's own step
    return runner_lib.steps.compiled(graphdef, opts, cache_sh).decode, args


def _path(keypath) -> tuple[str, ...]:
    return tuple(str(key_name(k)) for k in keypath if key_name(k) != "value")


def lower_decode(cfg: ModelConfig, model, dep: Deployment, platform: str):
    """The runner's decode step traced and lowered for `platform` on the abstract mesh."""
    mesh = sharding.abstract_mesh(dep.mesh, math.prod(dep.mesh.values()))
    decode, args = decode_step_args(cfg, model, mesh, dep)
    with jax.sharding.use_abstract_mesh(mesh):
        return decode.trace(*args).lower(lowering_platforms=(platform,))


def compiled_memory(cfg: ModelConfig, model, dep: Deployment):
    """memory_analysis() per device of the decode step compiled for this host's devices."""
    mesh = sharding.make_mesh(dep.mesh)
    decode, args = decode_step_args(cfg, model, mesh, dep)
    with jax.set_mesh(mesh):
        return decode.trace(*args).lower().compile().memory_analysis()


def compiled_total(m) -> int:
    """Arguments + outputs - aliased (the donated cache, counted once) + temporaries."""
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


# The README's 671B deployments: (label, chip, devices, weights). Each is planned on the meshes of
# `candidate_meshes` and the table keeps the one with the largest batch at 32k tokens.
TABLE = (
    ("8 x H200, FP8", "h200", 8, "fp8"),
    ("16 x H100, FP8", "h100", 16, "fp8"),
    ("8 x H100, int4 experts", "h100", 8, "int4_experts"),
    ("TPU v5p-16 (8 chips), int4 experts", "v5p", 8, "int4_experts"),
    ("TPU v6e-64, FP8", "v6e", 64, "fp8"),
)


def candidate_meshes(devices: int) -> list[dict]:
    """Experts over `expert` (the cache's slots follow), with `tensor` x 1, 2, 4, 8 splitting heads,
    expert widths and the vocabulary (the cache is then repeated on the tensor ranks)."""
    return [{"tensor": t, "expert": devices // t} if t < devices else {"tensor": t}
            for t in (1, 2, 4, 8) if devices % t == 0]


def best_mesh(cfg: ModelConfig, dep: Deployment, devices: int, context: int, headroom: float) -> tuple[dict, dict]:
    """(the candidate mesh with the largest batch at `context`, {mesh text: that batch} for all)."""
    model = abstract_model(cfg)
    found = {}
    for mesh in candidate_meshes(devices):
        mesh = {a: s for a, s in mesh.items() if s > 1} or {"expert": 1}
        found[_mesh_text(mesh)] = (largest_batch(cfg, dataclasses.replace(dep, mesh=mesh), context,
                                                 headroom=headroom, model=model), mesh)
    text = max(found, key=lambda k: found[k][0])
    return found[text][1], {k: b for k, (b, _) in found.items()}


def _mesh_text(mesh: dict) -> str:
    return ",".join(f"{a}={s}" for a, s in mesh.items())


def report(cfg: ModelConfig, dep: Deployment, *, headroom: float, platforms: tuple[str, ...], out=sys.stdout) -> dict:
    """Prints one deployment's plan, its largest batch per context and its lowered decode steps."""
    model = abstract_model(cfg)
    p = plan(cfg, dep, headroom=headroom, model=model)
    chip = CHIPS[dep.chip.lower()]
    n = math.prod(dep.mesh.values())
    print(f"{n} x {chip.name} ({chip.hbm_bytes / GB:.0f} GB, {chip.source}); mesh {_mesh_text(dep.mesh)}; weights "
          f"{dep.weights}, cache {dep.cache_dtype}{', MTP' if dep.use_mtp else ''}; {dep.max_batch} slots x "
          f"{dep.context} tokens", file=out)
    print(f"  {'per device':<48}{'GB':>9}", file=out)
    for name, value in [("weights", p.weights), ("latent cache", p.cache), *p.working.items()]:
        print(f"  {name:<48}{value / GB:>9.2f}", file=out)
    print(f"  {'total':<48}{p.total / GB:>9.2f}  ({'fits' if p.fits else 'does not fit'} in "
          f"{headroom:.0%} of {chip.hbm_bytes / GB:.0f} GB)", file=out)
    largest = {c: largest_batch(cfg, dep, c, headroom=headroom, model=model) for c in CONTEXTS
               if c <= cfg.max_position_embeddings}
    print("  largest batch that fits: " + ", ".join(f"{b} x {c}" for c, b in largest.items()), file=out)
    lowered, held = {}, abstract_model(cfg, dep.weights, dep.group)
    for platform in platforms:
        t0 = time.perf_counter()
        text = lower_decode(cfg, held, dataclasses.replace(dep, max_batch=max(dep.max_batch, 1)), platform).as_text()
        lowered[platform] = time.perf_counter() - t0
        print(f"  decode step lowered for {platform} on the abstract {n}-device mesh in {lowered[platform]:.1f}s: "
              f"{text.count('all_to_all')} all-to-alls ({text.count('ragged_all_to_all')} ragged), weights held "
              f"{dep.weights}", file=out)
    return {"plan": p, "largest": largest, "lowered": lowered}


# -- routed experts offloaded to host RAM (--offload) -------------------------------------------
OFFLOAD_TABLE = (("671B int4, 1 x H200 + host RAM", "h200", 1), ("671B int4, 2 x H100 + host RAM", "h100", 2))
HIT_RATES = (0.5, 0.8, 0.9, 0.95, 0.99)


def expert_bytes(cfg: ModelConfig, weights: str, group: int) -> float:
    """One routed expert's w1, w3 ([D, F]) and w2 ([F, D]) in the weight format."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    w1_or_w3 = quantized_bytes((d, f), (0, 1), True, weights, group)
    return 2 * w1_or_w3 + quantized_bytes((f, d), (0, 1), True, weights, group)


def offload_plan(cfg: ModelConfig, chip: str, devices: int, *, weights: str = "int4", context: int = 32768,
                 headroom: float = 0.9, link: float | None = None) -> dict:
    """The offloaded deployment's bytes, its cache size C and the link's tokens/s bound (module docstring)."""
    dep = Deployment(chip, {"expert": devices}, weights, max_batch=devices, context=context)
    p = plan(cfg, dep, headroom=headroom, model=abstract_model(cfg))
    layers, e, eb = cfg.num_moe_layers, cfg.num_routed_experts, expert_bytes(cfg, weights, dep.group)
    resident = p.total - layers * e * eb / devices - p.working["one MoE layer's local experts (compute dtype)"]
    per_slot = layers * eb + 3.0 * cfg.hidden_size * cfg.moe_intermediate_size * 2  # + one layer's, bf16
    cache = min(e, math.floor((headroom * p.hbm - resident) * devices / per_slot))
    link = link if link is not None else CHIPS[chip].host_link_bytes
    moved = {h: layers * cfg.num_experts_per_token * (1 - h) * eb for h in HIT_RATES}
    fits = cache // cfg.num_experts_per_token  # one row's prefill tokens whose top-k experts fit in C slots
    chunk = 1 << (fits.bit_length() - 1) if fits else 0  # a power of two, as a prefill chunk is
    return {"resident": resident, "cache": cache, "prefill_chunk": chunk, "cache_bytes": cache * per_slot / devices,
            "host": layers * e * eb, "expert": eb, "link": link,
            "tokens_per_s": {h: devices * link / b for h, b in moved.items()}, "moved": moved, "hbm": p.hbm}


def offload_report(cfg: ModelConfig, *, context: int, headroom: float, link_gbps: float | None,
                   out=sys.stdout) -> list:
    rows = []
    for label, chip, devices in OFFLOAD_TABLE:
        r = offload_plan(cfg, chip, devices, context=context, headroom=headroom,
                         link=link_gbps * 1e9 if link_gbps else None)
        k, source = cfg.num_experts_per_token, "--host_link_gbps" if link_gbps else CHIPS[chip].source
        fits = (f"C = {r['cache']} of {cfg.num_routed_experts} per layer, --prefill_chunk={r['prefill_chunk']} keeps "
                f"a prefill within it") if r["cache"] >= k else \
            f"does not fit (C = {r['cache']} < top_k = {k})"
        print(f"== {label}: per device {r['resident'] / GB:.1f} GB resident + {r['cache_bytes'] / GB:.1f} GB expert "
              f"cache of {r['hbm'] / GB:.0f} GB x {headroom:.0%}: {fits}; host RAM {r['host'] / GB:.0f} GB, loaded "
              f"there directly ({r['expert'] / 1e6:.1f} MB per expert); host link {r['link'] / GB:.0f} GB/s x "
              f"{devices} ({source})", file=out)
        print("  tokens/s bound by the host link (one row, no MTP), by hit rate: " + ", ".join(
            f"{h:.2f}: {t:.1f} ({r['moved'][h] / GB:.2f} GB/token)" for h, t in r["tokens_per_s"].items()), file=out)
        rows.append(r)
    return rows


def paged_report(cfg: ModelConfig, deps: list, *, headroom: float, out=None) -> list[tuple[int, int]]:
    """Prints, for each (label, deployment) of a paged cache, how many concurrent requests of its
    length mix fit, beside the slot cache's slots of the mix's longest request; -> (paged, slots)."""
    mix, k = deps[0][1].mix, deps[0][1].page_size
    longest, mean = max(n for n, _ in mix), math.ceil(mix_tokens(mix))
    model, rows = abstract_model(cfg), []
    print(f"requests of {', '.join(f'{n} tokens x {float(w):.0%}' for n, w in mix)} (mean {mean} tokens, "
          f"{float(mix_pages(mix, k)):.1f} pages of {k}), cache {deps[0][1].cache_dtype}, {headroom:.0%} of HBM",
          file=out)
    print(f"  {'deployment':<36}{'mesh':<20}{'paged':>8}{f'slots x {longest}':>16}{'ratio':>8}"
          f"{'pages a device':>16}", file=out)
    for label, dep in deps:
        mesh = sharding.abstract_mesh(dep.mesh, math.prod(dep.mesh.values()))
        paged = largest_batch(cfg, dep, mean, headroom=headroom, model=model)
        slots = largest_batch(cfg, dataclasses.replace(dep, page_size=None, mix=()), longest, headroom=headroom,
                              model=model)
        pages = math.ceil(paged // runner_lib.token_shards(mesh) * mix_pages(mix, k))
        ratio = f"{paged / slots:.1f}x" if slots else "-"
        print(f"  {label:<36}{_mesh_text(dep.mesh):<20}{paged:>8}{slots:>16}{ratio:>8}{pages:>16}", file=out)
        rows.append((paged, slots))
    return rows


def parse_mix(text: str) -> tuple:
    """'512:0.9,32768:0.1' -> ((512, 9/10), (32768, 1/10)): the shares as exact fractions, normalised."""
    try:
        mix = [(int(n), fractions.Fraction(w)) for n, w in (item.split(":") for item in text.split(","))]
    except ValueError:
        cli.usage(f"--mix={text}: expected length:share pairs, comma-separated, e.g. 512:0.9,32768:0.1")
    total = sum(w for _, w in mix)
    return tuple((n, w / total) for n, w in mix) if total > 0 else tuple(mix)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_enum("model", "deepseek_v3", ["deepseek_v3", "deepseek_v3_2", "tiny"], "ModelConfig preset",
                      flag_values=fv)
    flags.DEFINE_enum("weights", "fp8", WEIGHTS, "how the projections are held", flag_values=fv)
    flags.DEFINE_enum("cache_dtype", "bfloat16", CACHE_DTYPES, "latent cache dtype", flag_values=fv)
    flags.DEFINE_string("chip", "h200", "one of " + ", ".join(c.name for c in CHIPS.values()), flag_values=fv)
    flags.DEFINE_string("mesh", "expert=8", "e.g. expert=8 or tensor=2,expert=4", flag_values=fv)
    flags.DEFINE_string("rules", "default", "sharding/rules.py preset", flag_values=fv)
    flags.DEFINE_integer("max_batch", 64, "decode slots", flag_values=fv)
    flags.DEFINE_integer("context", 32768, "tokens per slot (max_seq_len)", flag_values=fv)
    flags.DEFINE_boolean("use_mtp", False, "MTP speculation: its cache and K = 2 tokens per slot", flag_values=fv)
    flags.DEFINE_integer("group", 128, "int8/int4 scale group along the contraction axis", flag_values=fv)
    flags.DEFINE_float("headroom", 0.9, "share of HBM the plan may use", flag_values=fv)
    flags.DEFINE_string("platforms", None, "lower for these (default: the chip's), e.g. tpu,cuda", flag_values=fv)
    flags.DEFINE_boolean("check_compiled", False, "compile the step on this host's devices and compare "
                         "memory_analysis() with the plan", flag_values=fv)
    flags.DEFINE_boolean("table", False, "the README's 671B deployments, each on its best candidate mesh (--chip, "
                         "--mesh, --weights ignored)", flag_values=fv)
    flags.DEFINE_boolean("offload", False, "the 671B int4 deployments with routed experts in host RAM behind a "
                         "device cache (--chip, --mesh, --weights ignored)", flag_values=fv)
    flags.DEFINE_integer("page_size", None, "a paged cache of pages of this many tokens: how many concurrent "
                         "requests of --mix fit, beside the slot cache's count", flag_values=fv)
    flags.DEFINE_string("mix", "512:0.9,32768:0.1", "with --page_size: request lengths (prompt + new tokens) and "
                        "their shares, length:share comma-separated", flag_values=fv)
    flags.DEFINE_float("host_link_gbps", None, "with --offload: host -> device GB/s per device (default: the "
                       "chip's PCIe link)", flag_values=fv)


def parse_args(argv=None):
    args = cli.with_mesh(cli.parse(define_flags, argv, __doc__))
    if args.context <= 0 or not 0 < args.headroom <= 1:
        cli.usage(f"--context={args.context} must be positive and --headroom={args.headroom} in (0, 1]")
    if args.host_link_gbps is not None and (not args.offload or args.host_link_gbps <= 0):
        cli.usage(f"--host_link_gbps={args.host_link_gbps} is a positive GB/s of --offload's plan")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = getattr(ModelConfig, args.model)()
        dtype = "float32" if args.weights == "fp32" else "bfloat16"
        cfg = cfg.replace(compute_dtype=dtype, param_dtype=dtype)
        if args.offload:
            offload_report(cfg.replace(compute_dtype="bfloat16", param_dtype="bfloat16"), context=args.context,
                           headroom=args.headroom, link_gbps=args.host_link_gbps)
            return 0
        paged = {"page_size": args.page_size, "mix": parse_mix(args.mix)} if args.page_size is not None else {}
        deps = [(f"{math.prod(args.mesh.values())} x {args.chip}, {args.weights}",
                 Deployment(args.chip, args.mesh, args.weights, args.cache_dtype, args.max_batch, args.context,
                            args.use_mtp, args.rules, args.group, **paged))]
        if args.table:
            deps = []
            for label, chip, devices, weights in TABLE:
                dep = Deployment(chip, {}, weights, args.cache_dtype, args.max_batch, args.context, args.use_mtp)
                mesh, tried = best_mesh(cfg, dep, devices, 32768, args.headroom)
                print(f"== {label}: largest batch at 32768 tokens per mesh: {tried}; planned on {_mesh_text(mesh)}")
                deps.append((label, dataclasses.replace(dep, mesh=mesh, **paged)))
        if args.page_size is not None:
            paged_report(cfg, deps, headroom=args.headroom)
            return 0
        for _, dep in deps:
            platforms = tuple(args.platforms.split(",")) if args.platforms else (CHIPS[dep.chip.lower()].platform,)
            report(cfg, dep, headroom=args.headroom, platforms=platforms)
            if args.check_compiled:
                p, m = plan(cfg, dep, headroom=args.headroom), compiled_memory(cfg, abstract_model(cfg), dep)
                print(f"  compiled on this host, memory_analysis() per device: {compiled_total(m) / GB:.4f} GB = "
                      f"arguments {m.argument_size_in_bytes / GB:.4f} + outputs {m.output_size_in_bytes / GB:.4f} - "
                      f"aliased {m.alias_size_in_bytes / GB:.4f} + temporaries {m.temp_size_in_bytes / GB:.4f}; "
                      f"plan / compiled = {p.total / compiled_total(m):.3f}")
    except ValueError as e:  # MeshError, ShardingRuleError and a bad flag value are ValueErrors
        return cli.fail(e)
    return 0


if __name__ == "__main__":
    cli.exit_with(main())

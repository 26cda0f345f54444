"""experiments/plan_serving.py: weight bytes against the config's own parameter count, the serving
decode step lowered for TPU and CUDA on an abstract mesh, and the plan within 25% of XLA's
memory_analysis() of the same step compiled on 8 fake CPU devices."""

import dataclasses
import math
import sys

import jax
import pytest

from dsv3_jax import ModelConfig
from experiments import plan_serving as ps
from tests import helpers

CHECK = r'''
import os
from tests.helpers import fake_device_flags
os.environ["XLA_FLAGS"] = fake_device_flags(8)
from dsv3_jax import ModelConfig
from experiments import plan_serving as ps
cfg = ModelConfig.tiny(hidden_size=256, moe_intermediate_size=128, intermediate_size=512, num_heads=4, num_layers=3,
                       num_dense_layers=1, num_routed_experts=16, vocab_size=4096, kv_lora_rank=128,
                       max_position_embeddings=4096, param_dtype="float32", compute_dtype="float32")
model = ps.abstract_model(cfg)
# fp32: XLA:CPU runs bf16 arithmetic in fp32 (whole-stack fp32 copies of a bf16 cache), no TPU or GPU does
for mesh, cache, mtp in (({"tensor": 2, "expert": 4}, "float32", False), ({"data": 2, "expert": 4}, "int8", True)):
    dep = ps.Deployment("h100", mesh, "fp32", cache, max_batch=16, context=2048, use_mtp=mtp)
    plan = ps.plan(cfg, dep, model=model)
    compiled = ps.compiled_total(ps.compiled_memory(cfg, model, dep))
    print("RATIO", mesh, cache, plan.total / compiled, plan.cache / plan.total)
'''


def test_plan_within_a_quarter_of_the_compiled_step():
    res = helpers.run([sys.executable, "-c", CHECK], helpers.fake_device_env(), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    ratios = [line.split() for line in res.stdout.splitlines() if line.startswith("RATIO")]
    assert len(ratios) == 2, res.stdout
    for line in ratios:
        assert 0.75 <= float(line[-2]) <= 1.25, line


def test_weight_bytes_follow_the_parameter_count():
    """One device: bf16 is 2 bytes per parameter of the config's own count; fp8 about half (block
    scales are 4 bytes per 16384 weights, embedding, head, norms and router stay bf16); int4 experts
    save 1.5 bytes per routed-expert weight less their group scales (4 bytes per started group of 128)."""
    cfg = ModelConfig.tiny(param_dtype="bfloat16", compute_dtype="bfloat16")
    model = ps.abstract_model(cfg)
    mesh = ps.sharding.abstract_mesh({}, 1)
    counts = cfg.param_counts()
    total = counts["total"] + counts["mtp"]  # the server loads the MTP modules too
    size = {w: ps.weight_bytes(model, mesh, ps.Deployment("h100", {}, w)) for w in ps.WEIGHTS}
    routers = cfg.num_routed_experts * (cfg.num_moe_layers + cfg.num_mtp_layers)  # the biases, fp32 in bf16
    assert size["bf16"] == pytest.approx(2 * total + 2 * routers, rel=1e-6)
    assert size["fp32"] == pytest.approx(4 * total, rel=1e-6)
    stacks = cfg.num_routed_experts * (cfg.num_moe_layers + cfg.num_mtp_layers)
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    routed = 3 * stacks * d * f
    # w1, w3 contract over d (f rows each), w2 over f (d rows): one fp32 scale per started group of 128
    scales = 4 * stacks * (2 * f * -(-d // 128) + d * -(-f // 128))
    assert size["bf16"] - size["int4_experts"] == pytest.approx(routed * 1.5 - scales, rel=1e-6)
    assert size["int4"] < size["int4_experts"] < size["int8_experts"] < size["bf16"]
    assert 0.5 * size["bf16"] < size["fp8"] < 0.6 * size["bf16"]


MESH = {"tensor": 2, "expert": 4}


@pytest.mark.parametrize("weights", [w for w in ps.WEIGHTS if w in ps.QUANTIZED])
def test_weight_formulas_equal_the_quantized_models_shards(weights):
    """The planner's per-device weight bytes (formulas on the bf16 shapes) equal the bytes of the
    shards of the model actually quantized (`quantize_model`'s q and scale arrays, placed by
    `load_pretrained(mesh=...)`'s rules) on an abstract tensor=2 x expert=4 mesh."""
    cfg = ModelConfig.tiny(param_dtype="bfloat16", compute_dtype="bfloat16")
    mesh = ps.sharding.abstract_mesh(MESH, 8)
    held = ps.abstract_model(cfg, weights)
    where = ps._leaf_shardings(held, mesh, ps.sharding.get_rules("default"))
    leaves = jax.tree_util.tree_leaves_with_path(ps.nnx.state(held))
    shards = sum(math.prod(where[ps._path(p)].shard_shape(x.shape)) * x.dtype.itemsize for p, x in leaves)
    assert any(x.dtype.itemsize == 1 for _, x in leaves)  # held quantized
    assert ps.weight_bytes(ps.abstract_model(cfg), mesh, ps.Deployment("h100", MESH, weights)) == shards


@pytest.mark.parametrize("platform, weights, stored", [("tpu", "fp8", "f8E4M3FN"), ("cuda", "int4", "ui8")])
def test_decode_step_lowers_expert_parallel(platform, weights, stored):
    """The server's decode step on an abstract 8-device mesh, the weights held in the deployment's
    format: the routed experts exchange tokens by the ragged all-to-all (the collective TPU and GPU
    run) and the program takes the quantized arrays (fp8 values, int4 packed in bytes)."""
    cfg = ModelConfig.tiny(param_dtype="bfloat16", compute_dtype="bfloat16")
    dep = ps.Deployment("v5p", MESH, weights, max_batch=8, context=256, use_mtp=True)
    text = ps.lower_decode(cfg, ps.abstract_model(cfg, weights), dep, platform).as_text()
    assert "ragged_all_to_all" in text
    assert stored in text
    assert stored not in ps.lower_decode(cfg, ps.abstract_model(cfg), dataclasses.replace(dep, weights="bf16"),
                                         platform).as_text()


def test_offload_plan_command_prints_the_expert_bytes_host_ram_and_link_bound_of_the_671b():
    """`python -m experiments.plan_serving --offload` as the README runs it, checked against the 671B's shapes
    counted here: an int4 expert is w1, w3, w2 of 7168 x 2048 at half a byte each plus one fp32 scale
    per 128 weights; the host holds 58 layers x 256 of them; a token at hit rate h moves 58 x 8 x (1 - h);
    a one-row prefill chunk of P tokens needs up to 8 P experts a layer, so P is the power of two with 8 P <= C."""
    import re

    res = helpers.run_module("experiments.plan_serving", "--offload", "--host_link_gbps=32")
    assert res.returncode == 0, res.stderr[-3000:]
    expert = 3 * 7168 * 2048 * (0.5 + 4 / 128)
    rows = re.findall(r"== 671B int4, (\d) x (H\d+).*?C = (\d+) of 256 per layer, --prefill_chunk=(\d+) keeps"
                      r".*?host RAM (\d+) GB.*?\(([\d.]+) MB per expert\)"
                      r".*?\n.*?0\.90: ([\d.]+) ", res.stdout)
    assert [(n, chip) for n, chip, *_ in rows] == [("1", "H200"), ("2", "H100")], res.stdout
    for n, _, cache, chunk, host_gb, expert_mb, tokens in rows:
        chunk = int(chunk)  # the largest power of two whose chunk's top-8 experts fit in C
        assert chunk & (chunk - 1) == 0 and chunk * 8 <= int(cache) < 2 * chunk * 8
        assert float(expert_mb) == round(expert / 1e6, 1)
        assert int(host_gb) == round(58 * 256 * expert / 1e9)
        assert float(tokens) == pytest.approx(int(n) * 32e9 / (58 * 8 * 0.1 * expert), abs=0.06)
        assert 8 <= int(cache) < 256
    assert helpers.run_module("experiments.plan_serving", "--offload", "--headroom=2").returncode == 2


def test_paged_plan_counts_the_pages_a_mix_of_requests_holds(capsys):
    """`--page_size=128` on the 671B, 8 x H200, fp8 weights, bf16 cache, 90% of requests 500 tokens and
    10% 30000: a request holds ceil(length / 128) pages (4 and 235), a page 128 tokens x 61 layers x
    (latent 512 + rope 64) x 2 bytes (the config's cache shapes, counted here). The printed count of
    concurrent requests fits in 90% of HBM with those pages (the count printed) and 8 more (one per device) do not; the
    slot cache's count beside it is that of slots of 30000 tokens; a request holds 3450 tokens on
    average, so the paged count is about 30000 / 3450 times the slots'."""
    import re
    from fractions import Fraction

    assert ps.main(["--page_size=128", "--mix=500:0.9,30000:0.1"]) == 0
    row = re.search(r"8 x h200, fp8 +expert=8 +(\d+) +(\d+) +[\d.]+x +(\d+)", capsys.readouterr().out)
    paged, slots, pages = (int(n) for n in row.groups())
    cfg = ModelConfig.deepseek_v3().replace(compute_dtype="bfloat16", param_dtype="bfloat16")
    dep = ps.Deployment("h200", {"expert": 8}, "fp8")
    mesh, model = ps.sharding.abstract_mesh(dep.mesh, 8), ps.abstract_model(cfg)
    token_bytes = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    pages_a_request = Fraction(9, 10) * 4 + Fraction(1, 10) * 235
    mean_tokens = 3450

    def total(requests: int, paged: bool) -> float:
        mine = requests // 8  # each device's requests
        cache = 128 * token_bytes * math.ceil(mine * pages_a_request) if paged else token_bytes * mine * 30000
        working = ps.working_bytes(cfg, mesh, dep, requests, mean_tokens if paged else 30000, "cuda")
        return ps.weight_bytes(model, mesh, dep) + cache + sum(working.values())

    for count, is_paged in ((paged, True), (slots, False)):
        assert count % 8 == 0 and total(count, is_paged) <= 0.9 * 141e9 < total(count + 8, is_paged), count
    assert pages == math.ceil(paged // 8 * pages_a_request)
    assert 8 < paged / slots < 30000 / 3450 * 1.05
    with pytest.raises(SystemExit) as e:
        ps.main(["--page_size=128", "--mix=512:0.9,32768"])
    assert e.value.code == 2
    assert ps.main(["--page_size=128", "--mix=512:0.9,65536:0.1"]) == 2  # longer than --context

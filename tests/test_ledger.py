"""The compute ledger's FLOPs per token against the model's own shapes and XLA's cost analysis."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3, ModelConfig
from dsv3_jax.train import metrics, state as state_lib, step as step_lib
from experiments import ledger
from tests.helpers import run_module

CONFIGS = {
    "tiny": ModelConfig.tiny(),
    "tiny_no_q_lora": ModelConfig.tiny(q_lora_rank=None, num_mtp_layers=2),
    "deepseek_v3": ModelConfig.deepseek_v3(),
}


def matmul_weights_from_shapes(cfg: ModelConfig) -> int:
    """Matmul weights a token meets, read off the abstract model's parameter shapes: every
    matrix but the embedding (a gather), routed experts at top-k / E, the head once for the main
    model and once per MTP depth (the MTP modules share it)."""
    model = nnx.eval_shape(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        names = [str(getattr(k, "key", k)) for k in path if str(getattr(k, "key", k)) != ".value"]
        stacked = names[0] in ("dense_layers", "moe_layers", "mtp")
        if names[0] == "embed" or leaf.ndim - stacked < 2:  # the embedding; norms are vectors
            continue
        count = float(leaf.size)
        if names[-2:-1] == ["ffn"] and names[-1] in ("w1", "w2", "w3") and leaf.ndim - stacked == 3:
            count *= cfg.num_experts_per_token / cfg.num_routed_experts  # [E, ., .]: routed experts
        if names == ["head"]:
            count *= 1 + cfg.num_mtp_layers
        total += count
    return round(total)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matmul_weights_equal_the_abstract_models_count(name):
    cfg = CONFIGS[name]
    assert sum(metrics.matmul_weights_per_token(cfg).values()) == matmul_weights_from_shapes(cfg)


def test_xla_cost_analysis_counts_the_ledgers_matmuls():
    """One dense layer and the head (no loops, no routed experts: XLA:CPU's cost model counts a
    loop body once and a grouped matmul as dense over every expert). XLA's naive attention
    computes the whole masked T x T square, twice the ledger's causal half; the rest is XLA's
    elementwise work (norms, rope, softmax, loss), a few percent at width 256."""
    d, batch, seq = 256, 2, 64
    # head_loss_impl="full": the lowered (not yet compiled) program of the chunked head still holds
    # the forward's unused logits, which only the compiler removes
    cfg = ModelConfig.tiny(num_layers=1, num_dense_layers=1, num_mtp_layers=0, hidden_size=d,
                           intermediate_size=2 * d, q_lora_rank=3 * d // 4, kv_lora_rank=d // 2,
                           head_loss_impl="full")
    tx = optax.sgd(0.1)
    graphdef, state = jax.eval_shape(lambda: state_lib.init_train_state(DeepSeekV3(cfg, rngs=nnx.Rngs(0)), tx, 0))
    step = step_lib.make_train_step(graphdef, tx, lambda s: 0.1, mtp_weight=0.0, balance_weight=0.0,
                                    bias_update_speed=0.0)
    rows = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    lowered = step.func.lower(state, {"tokens": rows, "segment_ids": rows, "positions": rows}, **step.keywords)
    cost = lowered.cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    tokens = batch * seq
    full_square = 6 * sum(metrics.matmul_weights_per_token(cfg).values()) + 2 * metrics.attention_flops_per_token(cfg, seq)
    assert 1.0 <= xla_flops / (full_square * tokens) <= 1.08


def test_ledger_command_runs_the_papers_hours_backwards_and_forwards():
    """The MFU the paper's hours imply, fed back as the ledger's MFU, gives back those hours."""
    common = ["--ledger", "--model=deepseek_v3", "--config.data.seq_len=4096", "--config.data.batch_size=15360",
              "--ledger_tokens=14.8e12", "--ledger_chips=h800:2048,v5p:1024,v7x:512"]
    backwards = run_module("experiments.plan", *common, "--ledger_hours=2.664e6").stdout
    mfu = float(re.search(r"imply MFU ([\d.]+)% of the bf16 peak", backwards).group(1)) / 100
    assert 0.05 < mfu < 1.0
    forwards = run_module("experiments.plan", *common, f"--ledger_mfu={mfu}").stdout
    h800 = re.search(r"2048 x H800\s+[\d.]+\s+[\d,]+\s+([\d.]+)M", forwards)
    assert float(h800.group(1)) == pytest.approx(2.664, abs=0.001)
    flops = float(re.search(r"training FLOPs per token at 4096 tokens: ([\d.]+) G", forwards).group(1))
    assert flops * 1e9 == pytest.approx(metrics.flops_per_token(CONFIGS["deepseek_v3"], 4096), rel=1e-4)


def test_unknown_chip_is_named():
    with pytest.raises(ValueError, match="'a100x'"):
        ledger.parse_fleet("a100x:8")
    with pytest.raises(ValueError, match="COUNT"):
        ledger.parse_fleet("h800:0")

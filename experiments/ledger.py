"""The compute ledger: what a training run costs in FLOPs, step time and chip-hours.

    python -m experiments.plan --ledger --model=deepseek_v3 --config.data.seq_len=4096 \
        --config.data.batch_size=15360 --ledger_tokens=14.8e12 --ledger_chips=h800:2048,v5p:1024,v7x:512

FLOPs per token come from `dsv3_jax/train/metrics.py` (the one count the trainer's MFU uses): 6 x
the matmul weights one token meets, plus causal attention at the sequence length, plus MTP. The
dense-equivalent column is what a dense model with the same total (non-embedding) weights would
cost per token: 6 x those weights + the same attention; the ratio is what sparsity saves.

Step time = global tokens x FLOPs per token / (chips x peak x MFU); chip-hours for a token budget
likewise. Run backwards (`--ledger_hours`), the same identity gives the MFU that reported hours
imply: DeepSeek-V3's report gives 2.664M H800 GPU hours for pre-training on 14.8T tokens.
"""

from __future__ import annotations

from typing import NamedTuple

from dsv3_jax.train import metrics


class Chip(NamedTuple):
    """One accelerator: dense peak FLOP/s per chip (no sparsity), HBM, and where the figures are from."""

    name: str
    bf16_flops: float
    fp8_flops: float  # 0 where the chip has no FP8 matmul unit
    hbm_gib: float
    source: str


CHIPS = {c.name.lower().replace(" ", ""): c for c in (
    Chip("H800", 989.4e12, 1978.9e12, 80, "NVIDIA H800 SXM5 data sheet (H100 SXM5 compute, 80 GB HBM3)"),
    Chip("H100", 989.4e12, 1978.9e12, 80, "NVIDIA H100 Tensor Core GPU data sheet, SXM5, dense"),
    Chip("H200", 989.4e12, 1978.9e12, 141, "NVIDIA H200 Tensor Core GPU data sheet, SXM, dense"),
    Chip("B200", 2250e12, 4500e12, 180, "NVIDIA DGX B200 data sheet (72 / 144 PFLOPS per 8 GPUs), dense"),
    Chip("v5p", 459e12, 0.0, 95, "Google Cloud TPU v5p documentation: 459 bf16 TFLOPS, 95 GB HBM2e per chip"),
    Chip("v6e", 918e12, 0.0, 32, "Google Cloud TPU v6e (Trillium) documentation: 918 bf16 TFLOPS, 32 GB HBM"),
    Chip("v7x", 2307e12, 4614e12, 192, "Google Cloud TPU7x (Ironwood) documentation: 4,614 FP8 TFLOPS, 192 GB HBM"),
)}


def chip(name: str) -> Chip:
    key = name.lower().replace(" ", "")
    if key not in CHIPS:
        raise ValueError(f"unknown chip {name!r}; the ledger's table has {', '.join(c.name for c in CHIPS.values())}")
    return CHIPS[key]


class TokenCost(NamedTuple):
    """Training FLOPs per token, by part, and the dense equivalent."""

    matmul: float  # 6 x the main model's matmul weights a token meets
    attention: float  # causal scores and values, every layer and MTP block
    mtp: float  # 6 x the MTP modules' matmul weights (their attention is in `attention`)
    dense_equivalent: float  # 6 x every non-embedding weight of the main model + its attention

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.mtp


def token_cost(cfg, seq_len: int) -> TokenCost:
    weights = metrics.matmul_weights_per_token(cfg)
    counts = cfg.param_counts()
    attention = metrics.attention_flops_per_token(cfg, seq_len)
    dense_weights = counts["total"] - cfg.vocab_size * cfg.hidden_size
    main_attention = attention * cfg.num_layers / (cfg.num_layers + cfg.num_mtp_layers)
    return TokenCost(6.0 * weights["main"], attention, 6.0 * weights["mtp"], 6.0 * dense_weights + main_attention)


class LedgerRow(NamedTuple):
    chip: Chip
    chips: int
    step_s: float  # one global batch at the stated MFU
    tokens_per_s: float
    chip_hours: float  # for the token budget
    days: float
    dense_chip_hours: float


def ledger_row(cost: TokenCost, hw: Chip, chips: int, *, mfu: float, tokens_per_step: float, budget: float,
               fp8: bool = False) -> LedgerRow:
    peak = (hw.fp8_flops if fp8 and hw.fp8_flops else hw.bf16_flops) * chips * mfu
    seconds = budget * cost.total / peak
    return LedgerRow(hw, chips, tokens_per_step * cost.total / peak, peak / cost.total,
                     seconds * chips / 3600, seconds / 86400, budget * cost.dense_equivalent / peak * chips / 3600)


def implied_mfu(cost: TokenCost, hw: Chip, *, tokens: float, chip_hours: float, fp8: bool = False) -> float:
    """The MFU at which `chip_hours` of `hw` train `tokens` tokens."""
    peak = hw.fp8_flops if fp8 else hw.bf16_flops
    return tokens * cost.total / (chip_hours * 3600 * peak)


def print_ledger(cfg, seq_len: int, *, tokens_per_step: float, budget: float, mfu: float,
                 fleet: list[tuple[Chip, int]], hours: float = 0.0, hours_chip: Chip | None = None) -> None:
    cost = token_cost(cfg, seq_len)
    print(f"training FLOPs per token at {seq_len} tokens: {cost.total / 1e9:.2f} G = matmuls "
          f"{cost.matmul / 1e9:.2f} G + attention {cost.attention / 1e9:.2f} G + MTP {cost.mtp / 1e9:.2f} G; "
          f"dense equivalent {cost.dense_equivalent / 1e9:.2f} G ({cost.dense_equivalent / cost.total:.1f}x)")
    if hours:
        hw = hours_chip or fleet[0][0]
        print(f"{hours / 1e6:.3f}M {hw.name} hours for {budget / 1e12:.1f}T tokens imply MFU "
              f"{implied_mfu(cost, hw, tokens=budget, chip_hours=hours):.2%} of the bf16 peak "
              f"({hw.bf16_flops / 1e12:.0f} TFLOP/s)" + (
                  f", {implied_mfu(cost, hw, tokens=budget, chip_hours=hours, fp8=True):.1%} of the FP8 peak "
                  f"({hw.fp8_flops / 1e12:.0f} TFLOP/s)" if hw.fp8_flops else ""))
    print(f"at MFU {mfu:.0%} of the bf16 peak, {tokens_per_step / 1e6:.2f}M tokens a step, "
          f"{budget / 1e12:.1f}T tokens:")
    print(f"  {'chips':<14}{'step s':>9}{'tokens/s':>14}{'chip-hours':>14}{'days':>8}{'dense-equiv. chip-h':>21}")
    for hw, n in fleet:
        r = ledger_row(cost, hw, n, mfu=mfu, tokens_per_step=tokens_per_step, budget=budget)
        print(f"  {f'{n} x {hw.name}':<14}{r.step_s:>9.2f}{r.tokens_per_s:>14,.0f}{r.chip_hours / 1e6:>13.3f}M"
              f"{r.days:>8.1f}{r.dense_chip_hours / 1e6:>20.2f}M")
    print("  peaks: " + "; ".join(f"{hw.name}: {hw.source}" for hw, _ in fleet))


def parse_fleet(text: str) -> list[tuple[Chip, int]]:
    """'h800:2048,v5p:1024' -> [(H800, 2048), (v5p, 1024)]."""
    fleet = []
    for item in filter(None, text.split(",")):
        name, _, count = item.partition(":")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--ledger_chips item {item!r}: expected NAME:COUNT with COUNT >= 1")
        fleet.append((chip(name), int(count)))
    return fleet

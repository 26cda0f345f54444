"""Peak rates of the chips the benchmarks run on, each with its source, and a timed op's achieved
rates as fractions of them (benchmarks/bench_kernels.py, benchmarks/device_report.py).

Compute peaks are dense (NVIDIA's data sheets print the 2:4-sparsity figure first, twice the dense
one); HBM in TB/s (10^12 bytes). A chip without an FP8 matmul peak (`fp8_tflops` None) has its fp8
ops measured against the bf16 peak.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class Peak(NamedTuple):
    bf16_tflops: float  # dense
    fp8_tflops: float | None  # dense; None: no FP8 matmul unit
    hbm_tbs: float
    source: str


_H100 = "NVIDIA H100 Tensor Core GPU data sheet"
_TPU = "Google Cloud TPU documentation, system architecture page"
# device_kind substring -> Peak; the first match wins (the PCIe and NVL H100s before "H100").
PEAKS = {
    "H100 PCIe": Peak(756.0, 1513.0, 2.0, f"{_H100}, H100 PCIe column (dense)"),
    "H100 NVL": Peak(835.0, 1671.0, 3.9, f"{_H100}, H100 NVL column (dense)"),
    "H100": Peak(989.0, 1979.0, 3.35, f"{_H100}, H100 SXM column (dense)"),
    "H800": Peak(989.0, 1979.0, 3.35, "NVIDIA H800 SXM: the H100 SXM's tensor cores and HBM3 (dense)"),
    "H200": Peak(989.0, 1979.0, 4.8, "NVIDIA H200 Tensor Core GPU data sheet, H200 SXM column (dense)"),
    "TPU v4": Peak(275.0, None, 1.2, f"{_TPU}, TPU v4: 275 bf16 TFLOP/s, 1,200 GB/s HBM"),
    "TPU v5 lite": Peak(197.0, None, 0.819, f"{_TPU}, TPU v5e: 197 bf16 TFLOP/s, 819 GB/s HBM"),
    "TPU v5e": Peak(197.0, None, 0.819, f"{_TPU}, TPU v5e: 197 bf16 TFLOP/s, 819 GB/s HBM"),
    "TPU v5p": Peak(459.0, None, 2.765, f"{_TPU}, TPU v5p: 459 bf16 TFLOP/s, 2,765 GB/s HBM"),
    "TPU v5": Peak(459.0, None, 2.765, f"{_TPU}, TPU v5p: 459 bf16 TFLOP/s, 2,765 GB/s HBM"),
    "TPU v6": Peak(918.0, None, 1.64, f"{_TPU}, TPU v6e: 918 bf16 TFLOP/s (its 1,836 are int8 TOPS), "
                                      "1,640 GB/s HBM"),
    "TPU7x": Peak(2307.0, 4614.0, 7.37, f"{_TPU}, TPU7x: 4,614 FP8 TFLOP/s (bf16 half), 7.37 TB/s HBM"),
}


def device_peak() -> tuple[str, Peak | None]:
    """(device_kind of the default device, its Peak or None: CPU or a chip not in the table)."""
    kind = jax.devices()[0].device_kind
    for key, peak in PEAKS.items():
        if key.lower() in kind.lower():
            return kind, peak
    return kind, None


def achieved(seconds: float, flops: float, bytes_: float, peak: Peak | None, fp8: bool) -> dict:
    """TFLOP/s and GB/s of an op that did `flops` and moved `bytes_` in `seconds`, and (with a peak)
    each as a fraction of the chip's: compute against the fp8 peak for an fp8 op, else bf16."""
    out = {"s": seconds, "tflops": flops / seconds / 1e12, "gbs": bytes_ / seconds / 1e9,
           "frac_compute": None, "frac_hbm": None}
    if peak is not None:
        compute = (peak.fp8_tflops or peak.bf16_tflops) if fp8 else peak.bf16_tflops
        out.update(frac_compute=out["tflops"] / compute, frac_hbm=out["gbs"] / 1e3 / peak.hbm_tbs)
    return out

"""`python -m benchmarks.bench_kernels` (README's kernel benchmark) end to end, at toy sizes."""

import re

from tests.helpers import run_module

KERNELS = ("fp8_matmul", "fp8_grouped_matmul", "mla_decode", "indexer_scores", "sparse_mla_decode", "mla_prefill fwd",
           "mla_prefill fwd+bwd")


def test_bench_kernels_prints_each_kernels_error_and_times():
    result = run_module("benchmarks.bench_kernels", "--iters=1", "--m=128", "--n=128", "--k=256", "--groups=2",
                        "--heads=4", "--decode_len=128", "--prefill_len=64", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in KERNELS:
        line = re.search(rf"^{re.escape(name)}\s+err\s+(\S+)\s+kernel\s+\S+ ms\s+ref\s+\S+ ms", result.stdout, re.M)
        assert line, f"no line for {name} in:\n{result.stdout}"
        assert float(line.group(1)) < 1e-2, line.group(0)  # bf16 outputs (fp8 and decode: fp32 partials)

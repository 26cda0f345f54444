"""Training metrics: model FLOPs and MFU, the metrics.jsonl / TensorBoard writer, the console line.

FLOPs per token (training = 3x forward): 6 x the matmul weights one token meets (attention
projections, dense MLPs, top-k + shared experts and the routers of every layer, the output head;
each MTP depth its own projection, block and the shared head again; the embedding is a gather and
the norms are elementwise, so neither counts) + causal attention, 3 x 2 x H x (qk_head_dim +
v_head_dim) x T/2 per layer, MTP blocks included (scores and the weighted sum over T/2 keys on
average).

Peak FLOP/s per device: a table of dense bf16 peaks by `device_kind` for accelerators; on CPU (or
an unknown kind) a short fp32 matmul benchmark measured once; `train.peak_flops_per_device` in the
config overrides both.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp

from dsv3_jax import paths

# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets (substring of device_kind).
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12, "TPU7x": 2307e12,
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12, "A800": 312e12,
    "L40S": 362e12, "A10G": 70e12,
}


def matmul_weights_per_token(cfg) -> dict[str, int]:
    """Matmul weights one token meets in the forward, by part: "main" (layers and head), "mtp"."""
    d, v = cfg.hidden_size, cfg.vocab_size
    attention, moe = cfg.attention_weights(), cfg.moe_weights(cfg.num_experts_per_token)
    dense = 3 * d * cfg.intermediate_size
    main = cfg.num_dense_layers * (attention + dense) + cfg.num_moe_layers * (attention + moe) + d * v
    return {"main": main, "mtp": cfg.num_mtp_layers * (2 * d * d + attention + moe + d * v)}


def attention_flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs of causal attention scores and values per token, all layers and MTP blocks."""
    layers = cfg.num_layers + cfg.num_mtp_layers
    return 3 * 2 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * (seq_len / 2) * layers


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token of a `ModelConfig` at context `seq_len` (see the module docstring)."""
    return 6.0 * sum(matmul_weights_per_token(cfg).values()) + attention_flops_per_token(cfg, seq_len)


def measure_cpu_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` jitted fp32 [n, n] matmuls on the default device."""
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def peak_flops_per_device(override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure came from)."""
    if override > 0:
        return override, "config train.peak_flops_per_device"
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return peak, f"table entry {name!r} for device kind {kind!r}"
    return measure_cpu_flops(), f"fp32 matmul benchmark on {kind!r}"


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsWriter:
    """Appends one JSON object per logged step to DIR/metrics.jsonl and scalars to TensorBoard.

    On resume from step S the lines of steps > S (written after the checkpoint, before a crash)
    are dropped, so the file reads like an uninterrupted run. DIR may be a URL (dsv3_jax/paths.py):
    an object store has no append, so there the file is rewritten whole on every write (as
    TensorBoard's own GCS writer does on every flush), and a killed run loses no logged line.
    DIR must exist (the trainer makes it).
    """

    def __init__(self, workdir: str, resume_step: int = 0):
        self.path = paths.join(workdir, "metrics.jsonl")
        self._lines = self._kept_lines(resume_step)  # rewritten whole on a URL; a local file is appended to
        paths.write_text(self.path, "".join(self._lines))
        self._file = None if paths.is_url(self.path) else open(self.path, "a")
        from tensorboardX import SummaryWriter  # imported here: only the writer needs it
        self._tb = SummaryWriter(paths.join(workdir, "tensorboard"))

    def _kept_lines(self, step: int) -> list[str]:
        if not paths.at(self.path).exists():
            return []
        records = [line for line in paths.at(self.path).read_text().splitlines(keepends=True) if line.strip()]
        return [line for line in records if json.loads(line)["step"] <= step]

    def write(self, record: dict):
        """`record`: JSON values (Python numbers and lists, as the loop makes them)."""
        line = json.dumps(record) + "\n"
        if self._file is None:
            self._lines.append(line)
            paths.write_text(self.path, "".join(self._lines))
        else:
            self._file.write(line)
            self._file.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, record["step"])

    def close(self):
        if self._file is not None:
            self._file.close()
        self._tb.close()


class Progress:
    """Throughput since the last report and ETA at the mean rate since the first (compile time excluded)."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.first = self.last = None  # (step, time)

    def tick(self, step: int) -> tuple[float, float]:
        """Returns (steps/s since the last tick, seconds left), step = steps done so far."""
        now = time.perf_counter()
        if self.first is None:  # the first call follows compilation: start the clock here
            self.first = self.last = (step, now)
            return float("nan"), float("nan")
        rate = (step - self.last[0]) / max(now - self.last[1], 1e-9)
        mean_rate = (step - self.first[0]) / max(now - self.first[1], 1e-9)
        self.last = (step, now)
        return rate, (self.total - step) / max(mean_rate, 1e-9)

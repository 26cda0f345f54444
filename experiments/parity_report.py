"""Prints fp32 and bf16 agreement with HF transformers on the committed parity fixtures.

For each fixture (tests/fixtures/parity, fp32 logits computed by HF DeepseekV3ForCausalLM): the
max |logit diff| / max |logit| in fp32, and with bf16 parameters and compute the max |diff| and the
mean KL(HF fp32 || ours bf16) per token.

    python -m experiments.parity_report
"""

from __future__ import annotations

import os

import jax
import numpy as np

from dsv3_jax import load_pretrained

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "tests", "fixtures", "parity")


def _kl(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    p = jax.nn.log_softmax(ref_logits.astype(np.float64), axis=-1)
    q = jax.nn.log_softmax(logits.astype(np.float64), axis=-1)
    return float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))


def main() -> None:
    print(f"{'fixture':22s} {'fp32 rel':>10s} {'bf16 max|d|':>12s} {'bf16 rel':>9s} {'bf16 KL':>9s} {'max|logit|':>10s}")
    for name in sorted(os.listdir(FIXTURES)):
        folder = os.path.join(FIXTURES, name)
        golden = np.load(os.path.join(folder, "golden.npz"))
        ref = golden["logits"]
        scale = np.abs(ref).max()
        fp32 = np.asarray(load_pretrained(folder, dtype="float32")(golden["tokens"]))
        bf16 = np.asarray(load_pretrained(folder, dtype="bfloat16")(golden["tokens"]))
        print(f"{name:22s} {np.abs(fp32 - ref).max() / scale:10.2e} {np.abs(bf16 - ref).max():12.4f} "
              f"{np.abs(bf16 - ref).max() / scale:9.4f} {_kl(ref, bf16):9.2e} {scale:10.2f}")


if __name__ == "__main__":
    main()

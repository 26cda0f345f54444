"""Greedy generation with chunked prefill (chunks smaller than the prompt) on every HF parity
fixture, YaRN ones included, against the argmax of the full-sequence forward."""

import os

import numpy as np
import pytest

from dsv3_jax import load_pretrained
from dsv3_jax.inference import generate
from tests.inference.conftest import full_forward_greedy
from tests.parity_configs import PARITY_CONFIGS

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "parity")
MAX_NEW = 4


@pytest.mark.parametrize("name", [*PARITY_CONFIGS, "mtp_depth2"])
def test_chunked_greedy_equals_full_forward_argmax(name):
    model = load_pretrained(os.path.join(FIXTURES, name))
    prompts = np.load(os.path.join(FIXTURES, name, "golden.npz"))["tokens"][:2]
    lengths = np.array([prompts.shape[1], prompts.shape[1] - 3], np.int32)
    expected, gap = full_forward_greedy(model, prompts, lengths, MAX_NEW)
    assert gap > 1e-4, f"reference argmax is a near-tie (gap {gap})"
    use_mtp = model.config.num_mtp_layers > 0
    out = np.asarray(generate(model, prompts, MAX_NEW, lengths=lengths, prefill_chunk=4, use_mtp=use_mtp))
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(out[b, :n + MAX_NEW], expected[b, :n + MAX_NEW], err_msg=f"row {b}")

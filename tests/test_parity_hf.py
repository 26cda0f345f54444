"""Logit parity with HF transformers' DeepseekV3ForCausalLM (fp32, eager attention and experts).

Two routes: live (builds the HF model with torch, saves it with save_pretrained, loads it with
load_pretrained) and golden (the committed fixtures made by tests/fixtures/make_parity_fixtures.py,
no torch needed). Tolerance: max |diff| <= 1e-4 * max |logit|.
"""

import json
import os

import numpy as np
import pytest

from dsv3_jax import load_pretrained
from tests.helpers import rel_err
from tests.parity_configs import MTP_CONFIG, PARITY_CONFIGS

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "parity")
TOL = 1e-4


@pytest.mark.parametrize("name", [*PARITY_CONFIGS, "mtp_depth2"])
def test_golden_fixture(name):
    folder = os.path.join(FIXTURES, name)
    golden = np.load(os.path.join(folder, "golden.npz"))
    with open(os.path.join(folder, "reference.json")) as f:
        assert json.load(f)["transformers"].startswith("5.")
    model = load_pretrained(folder)
    out = model.forward(golden["tokens"])
    assert np.max(np.abs(golden["logits"])) > 1.0  # O(1) logits, or the comparison proves little
    assert rel_err(out.logits, golden["logits"]) <= TOL
    depth = sum(k.startswith("mtp_logits_") for k in golden.files)
    assert depth == model.config.num_mtp_layers
    t = golden["tokens"].shape[1]
    for k in range(1, depth + 1):
        assert rel_err(out.mtp_logits[k - 1][:, : t - k], golden[f"mtp_logits_{k}"]) <= TOL


def test_configs_cover_the_acceptance_grid():
    cfgs = [spec["cfg"] for spec in PARITY_CONFIGS.values()]
    assert any(c.q_lora_rank is None for c in cfgs) and any(c.q_lora_rank for c in cfgs)
    assert any(1 < c.num_groups_per_token < c.num_expert_groups or
               (c.num_groups_per_token == 1 < c.num_expert_groups) for c in cfgs)
    assert any(c.yarn is None for c in cfgs) and any(c.yarn is not None for c in cfgs)
    assert {1} <= {c.num_dense_layers for c in cfgs} and max(c.num_dense_layers for c in cfgs) > 1
    assert all(spec["batch"] > 1 for spec in PARITY_CONFIGS.values())


@pytest.fixture(scope="module")
def hf():
    import torch  # noqa: F401  (the parity extra; CI installs it)

    from tests import hf_reference

    return hf_reference


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_live_hf(name, hf, tmp_path):
    spec = PARITY_CONFIGS[name]
    model = hf.build_hf_model(spec["cfg"], seed=7)
    tokens = np.random.default_rng(1).integers(0, spec["cfg"].vocab_size, (spec["batch"], spec["length"]))
    ref = hf.hf_logits(model, tokens)
    hf.save_hf(model, str(tmp_path), spec["shard_bytes"])
    assert rel_err(load_pretrained(tmp_path)(tokens.astype(np.int32)), ref) <= TOL


def test_live_hf_mtp(hf, tmp_path):
    main = hf.build_hf_model(MTP_CONFIG["cfg"], seed=3)
    mtp = hf.build_hf_mtp(main, seed=4)
    tokens = np.random.default_rng(2).integers(0, 128, (MTP_CONFIG["batch"], MTP_CONFIG["length"]))
    refs = hf.hf_mtp_logits(main, mtp, tokens)
    hf.save_hf_with_mtp(main, mtp, str(tmp_path))
    out = load_pretrained(tmp_path).forward(tokens.astype(np.int32))
    t = tokens.shape[1]
    for k, ref in enumerate(refs, 1):
        assert rel_err(out.mtp_logits[k - 1][:, : t - k], ref) <= TOL

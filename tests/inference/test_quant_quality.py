"""`python -m research.quant_quality` on the session's trained run, its figures recomputed here in
numpy from the same loads: perplexity and KL from the full forward, greedy continuations by
re-running the full forward (no cache), and the fp32 cache's perplexity from the cache-free forward."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax import load_pretrained
from research.quant_quality import heldout_batches, parse_args
from tests.helpers import run_module
from tests.inference.conftest import full_forward_greedy

GROUP, PROMPTS, PROMPT_LEN, NEW = 8, 2, 8, 4


def _log_softmax(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _log_probs(model, tokens, positions=None, segment_ids=None):
    out = model.forward(jnp.asarray(tokens), positions=None if positions is None else jnp.asarray(positions),
                        segment_ids=None if segment_ids is None else jnp.asarray(segment_ids), with_mtp=False)
    return _log_softmax(out.logits)


@pytest.fixture(scope="module")
def report(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("quant_quality") / "figures.json"
    res = run_module("research.quant_quality", f"--checkpoint={trained_run}", "--arms=int4_all,cache_float32",
                     "--eval_batches=1", f"--prompts={PROMPTS}", f"--prompt_len={PROMPT_LEN}", f"--new_tokens={NEW}",
                     "--cache_prefill=16", f"--quant_group={GROUP}", f"--json={out}", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| int4_all | int4 | all | float32 |" in res.stdout and "| cache_float32 |" in res.stdout, res.stdout
    return json.loads(out.read_text())


def test_figures_equal_an_independent_computation(report, trained_run):
    arms = report["arms"]
    ref = arms["unquantized"]
    assert ref["kl"] == 0.0 and ref["agreement"] == 1.0 and ref["identical_prompts"] == PROMPTS

    dense = load_pretrained(trained_run, dtype="float32")
    int4 = load_pretrained(trained_run, dtype="float32", weights="int4", quantize="all", quant_group=GROUP)
    (batch,) = heldout_batches(str(trained_run), dense.config.vocab_size, 1)
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    mask = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    targets = tokens[:, 1:]
    logp_ref = _log_probs(dense, tokens[:, :-1], pos[:, :-1], seg[:, :-1])
    logp_q = _log_probs(int4, tokens[:, :-1], pos[:, :-1], seg[:, :-1])
    nll = -np.take_along_axis(logp_q, targets[..., None], -1)[..., 0][mask]
    kl = (np.exp(logp_ref) * (logp_ref - logp_q)).sum(-1)[mask]
    assert ref["tokens"] == arms["int4_all"]["tokens"] == mask.sum()
    assert abs(arms["int4_all"]["perplexity"] / np.exp(nll.mean()) - 1) < 1e-5
    assert kl.mean() > 1e-6 and abs(arms["int4_all"]["kl"] / kl.mean() - 1) < 1e-3

    rows = tokens[(seg > 0).all(1)]  # whole rows: the cache arms' streams and the prompts
    stream = rows[:, :-1]
    logp_stream = _log_probs(dense, stream)
    nll_stream = -np.take_along_axis(logp_stream, rows[:, 1:, None], -1)[..., 0]
    assert abs(arms["cache_float32"]["perplexity"] / np.exp(nll_stream.mean()) - 1) < 1e-4
    assert arms["cache_float32"]["kl"] < 1e-6  # absorbed (cached) and expanded MLA are one formula

    prompts = rows[:PROMPTS, :PROMPT_LEN].astype(np.int32)
    lengths = np.full(PROMPTS, PROMPT_LEN, np.int32)
    want = full_forward_greedy(dense, prompts, lengths, NEW)[0][:, PROMPT_LEN:]
    got = full_forward_greedy(int4, prompts, lengths, NEW)[0][:, PROMPT_LEN:]
    assert arms["int4_all"]["agreement"] == pytest.approx((got == want).mean())
    assert arms["int4_all"]["identical_prompts"] == (got == want).all(1).sum()


def test_bad_flags_exit_2_naming_them(capsys):
    for argv, flag in ((["--checkpoint=RUN", "--arms=int3"], "--arms"), (["--workdir=RUN"], "--train_steps"),
                       (["--checkpoint=RUN", "--prompts=0"], "--prompts")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and flag in capsys.readouterr().err.strip().splitlines()[-1], argv

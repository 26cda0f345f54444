"""lm-evaluation-harness (`local-completions`, the pinned 0.4.x of the test extra) against
`python -m experiments.serve`: a multiple-choice task and a `loglikelihood_rolling` task, written
here as local jsonl, run with `batch_size=4` and lm-eval's default tokenizer backend (it finds the
server's /tokenizer_info and /tokenize). Every per-example log-likelihood equals the served
checkpoint's own full forward in fp32 (within 1e-4), and accuracy equals the offline argmax.
Nothing is downloaded: the hub and datasets run offline with an empty HF_HOME, so the tokenizer can
only be the server's (the model name is no hub id either)."""

import json

import numpy as np
import pytest

from tests.serving.conftest import SCORED_LEN

TOL = 1e-4
QUESTIONS = [
    ("The fox jumped over the", ["lazy dog", "moon", "fence post", "river bank"], 0),
    ("Water boils at a temperature of", ["100 degrees", "ten", "zero degrees", "a lot"], 0),
    ("Once upon a time there lived a", ["king", "queen in a castle", "fox", "small mouse"], 2),
    ("The sky is", ["blue", "green today", "falling", "very far away"], 0),
    ("She opened the door and saw", ["nothing", "a cat", "the sea", "her old friend"], 3),
]
TEXTS = ["A fox and a dog lived in the same house for many years.",
         "Rain fell on the town all night, and in the morning the river had risen.",
         "Numbers: 1, 2, 3, 5, 8, 13, 21.",
         "The end."]

MC_TASK = """task: served_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
ROLLING_TASK = """task: served_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def evaluation(server, tmp_path_factory):
    """lm-eval's results with per-sample records, one run over both tasks."""
    folder = tmp_path_factory.mktemp("lm_eval")
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                             for q, c, a in QUESTIONS))
    (folder / "rolling.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (folder / "served_mc.yaml").write_text(MC_TASK.format(data=folder / "mc.jsonl"))
    (folder / "served_rolling.yaml").write_text(ROLLING_TASK.format(data=folder / "rolling.jsonl"))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        mp.setenv("HF_HOME", str(folder / "hf_home"))  # an empty cache: anything not offline-capable would fail
        import lm_eval
        from lm_eval.tasks import TaskManager

        url, name = server
        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={url}/v1/completions,model={name},max_length={SCORED_LEN}",
            tasks=["served_mc", "served_rolling"], task_manager=TaskManager(include_path=str(folder),
                                                                            include_defaults=False),
            batch_size=4, log_samples=True)


def test_multiple_choice_loglikelihoods_and_accuracy(evaluation, tok, ref):
    samples = sorted(evaluation["samples"]["served_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(QUESTIONS)
    correct, worst = [], 0.0
    for (question, choices, answer), sample in zip(QUESTIONS, samples):
        served = np.array([float(r[0]) for r in sample["filtered_resps"]])
        context = tok.encode(question)  # the pair lm-eval scores: context, then " " + choice
        sequences = [tok.encode(f"{question} {c}") for c in choices]
        assert all(s[:len(context)] == context for s in sequences)
        offline = np.array([ref.scored(s)[len(context) - 1:].sum() for s in sequences])
        np.testing.assert_allclose(served, offline, atol=TOL, rtol=0)
        worst = max(worst, float(np.abs(served - offline).max()))
        correct.append(int(np.argmax(offline)) == answer)
    print(f"multiple choice: max |served - full forward| {worst:.2e}, acc {np.mean(correct)}")
    assert evaluation["results"]["served_mc"]["acc,none"] == pytest.approx(np.mean(correct))


def test_rolling_loglikelihoods_equal_the_full_forward(evaluation, tok, ref):
    samples = sorted(evaluation["samples"]["served_rolling"], key=lambda s: s["doc_id"])
    assert len(samples) == len(TEXTS)
    worst = 0.0
    for text, sample in zip(TEXTS, samples):
        served = float(np.ravel(sample["filtered_resps"])[0])
        offline = ref.scored([tok.bos_id] + tok.encode(text)).sum()  # lm-eval's prefix token: the server's BOS
        assert abs(served - offline) < TOL, (text, served, offline)
        worst = max(worst, abs(served - offline))
    print(f"rolling: max |served - full forward| {worst:.2e}")
    words = sum(len(t.split()) for t in TEXTS)
    offline_total = sum(ref.scored([tok.bos_id] + tok.encode(t)).sum() for t in TEXTS)
    assert evaluation["results"]["served_rolling"]["word_perplexity,none"] == pytest.approx(
        np.exp(-offline_total / words), rel=1e-4)

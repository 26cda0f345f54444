"""/v1/completions log-probabilities, echo and several prompts, through the OpenAI client against
`python -m experiments.serve`, checked against the served checkpoint's own full forward (fp32)."""

import numpy as np
import openai
import pytest


TOL = 1e-4
PROMPT_IDS = [[17, 300, 5, 999, 42, 7, 1500, 64, 3, 88, 12, 401, 77, 1024, 9, 250, 31, 600, 2000, 11, 5, 8],
              [1, 90, 91, 92]]  # the first longer than a prefill chunk (16), the second starts with BOS


def _top_values(row: np.ndarray, k: int) -> np.ndarray:
    return np.sort(row)[::-1][:k]


def test_echo_scores_every_prompt_token_of_several_id_prompts(client, model, ref):
    """lm-eval's request: several id prompts, echo, logprobs=1, max_tokens=1, temperature 0."""
    out = client.completions.create(model=model, prompt=PROMPT_IDS, echo=True, logprobs=3, max_tokens=1, temperature=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1]
    for ids, choice in zip(PROMPT_IDS, out.choices):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = ref.logprobs([ids])[0]
        got = np.array(lp.token_logprobs[1:len(ids)])
        np.testing.assert_allclose(got, want[np.arange(len(ids) - 1), ids[1:]], atol=TOL, rtol=0)
        for i in range(1, len(ids) + 1):  # the 3 best (the chosen token added when it is not among them)
            values = sorted(lp.top_logprobs[i].values(), reverse=True)[:3]
            np.testing.assert_allclose(values, _top_values(want[i - 1], 3), atol=TOL, rtol=0)
        assert lp.tokens == [f"token_id:{i}" for i in ids + [int(np.argmax(want[-1]))]]  # greedy: the argmax
        np.testing.assert_allclose(lp.token_logprobs[-1], want[-1].max(), atol=TOL, rtol=0)
        assert choice.logprobs.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


def test_text_prompt_gets_bos_and_id_prompt_is_verbatim(client, model, tok):
    text = client.completions.create(model=model, prompt="a fox", echo=True, logprobs=0, max_tokens=0)
    ids = [tok.bos_id] + tok.encode("a fox")
    assert text.choices[0].logprobs.tokens == [tok.decode([i]) for i in ids]
    assert text.choices[0].text == "a fox" and text.usage.prompt_tokens == len(ids)
    verbatim = client.completions.create(model=model, prompt=ids[1:], echo=True, logprobs=0, max_tokens=0)
    assert verbatim.usage.prompt_tokens == len(ids) - 1


def test_max_tokens_zero_with_echo_scores_the_prompt_only(client, model, ref):
    ids = PROMPT_IDS[0]
    out = client.completions.create(model=model, prompt=ids, echo=True, logprobs=1, max_tokens=0, temperature=0.7,
                                    presence_penalty=1.0)  # the prompt is scored by the model itself, unscaled
    c = out.choices[0]
    assert c.finish_reason == "length" and out.usage.completion_tokens == 0 and len(c.logprobs.tokens) == len(ids)
    np.testing.assert_allclose(c.logprobs.token_logprobs[1:], ref.scored(ids), atol=TOL, rtol=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens=0"):
        client.completions.create(model=model, prompt=ids, max_tokens=0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generated_logprobs_are_of_the_sampled_distribution(client, model, ref, temperature):
    """Each generated token's log-probability is log_softmax(logits / T) of the full forward over
    prompt + what came before it (T = 1 when greedy; greedy tokens are its argmax); streamed
    chunks carry the same tokens and values."""
    ids = PROMPT_IDS[0]
    args = dict(model=model, prompt=ids, logprobs=5, max_tokens=20, temperature=temperature, seed=3,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    out = client.completions.create(**args).choices[0]
    tokens = [int(t.removeprefix("token_id:")) for t in out.logprobs.tokens]
    assert len(tokens) == 20
    rows = ref.logprobs([ids + tokens])[0][len(ids) - 1:-1] / (temperature or 1.0)  # each scores the next token
    scaled = rows - np.log(np.exp(rows).sum(-1, keepdims=True))  # rows are log-probs: no overflow
    if temperature == 0:
        assert tokens == [int(np.argmax(r)) for r in rows]
    np.testing.assert_allclose(out.logprobs.token_logprobs, scaled[np.arange(20), tokens], atol=TOL, rtol=0)
    for top, s in zip(out.logprobs.top_logprobs, scaled):
        np.testing.assert_allclose(sorted(top.values(), reverse=True)[:5], _top_values(s, 5), atol=TOL, rtol=0)
    chunks = list(client.completions.create(stream=True, **args))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == out.logprobs.tokens
    np.testing.assert_allclose([v for lp in streamed for v in lp.token_logprobs], out.logprobs.token_logprobs,
                               atol=1e-6, rtol=0)

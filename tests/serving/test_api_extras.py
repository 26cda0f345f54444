"""vLLM's request extras through the official openai client against `python -m experiments.serve`:
`prompt_logprobs` (checked against the served checkpoint's own full forward), `include_stop_str_in_output`,
`skip_special_tokens` and chat `echo` (checked against the same request without them)."""

import numpy as np
import openai
import pytest

from tests.serving.test_api_logprobs import PROMPT_IDS, TOL
from tests.serving.test_api_surface import call


def test_prompt_logprobs_are_the_full_forward_s_with_ranks(client, model, ref, tok):
    """vLLM's shape: the first entry null, then {token id: {logprob, rank, decoded_token}} of the prompt token
    and the k most likely, ranked 1..k; the prompt token's rank counts the tokens at least as likely."""
    ids, k = PROMPT_IDS[0], 3
    out = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": k})
    got, want = out.choices[0].prompt_logprobs, ref.logprobs([ids])[0]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row, entry = want[i - 1], got[i]
        top = np.argsort(-row)[:k]
        assert list(entry)[0] == str(ids[i]) and set(entry) == {str(ids[i])} | {str(t) for t in top}
        for rank, t in enumerate(top, 1):
            assert entry[str(t)]["rank"] == rank and entry[str(t)]["decoded_token"] == tok.decode([int(t)])
            np.testing.assert_allclose(entry[str(t)]["logprob"], row[t], atol=TOL, rtol=0)
        mine = entry[str(ids[i])]
        np.testing.assert_allclose(mine["logprob"], row[ids[i]], atol=TOL, rtol=0)
        rank = int((row >= row[ids[i]]).sum())
        assert mine["rank"] == (rank if rank <= 20 else None)


def test_chat_prompt_logprobs_sit_beside_the_choices(client, model, server):
    messages = [{"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                         extra_body={"prompt_logprobs": 0})
    prompt = call(server[0], "POST", "/tokenize", {"messages": messages})[1]["tokens"]
    scored = out.model_extra["prompt_logprobs"]
    assert len(scored) == out.usage.prompt_tokens == len(prompt) and scored[0] is None
    assert [list(entry) for entry in scored[1:]] == [[str(t)] for t in prompt[1:]]  # k = 0: the prompt token alone
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model=model, messages=messages, stream=True, extra_body={"prompt_logprobs": 1})


def test_include_stop_str_in_output(client, model):
    args = dict(model=model, prompt=PROMPT_IDS[0], max_tokens=16, temperature=0)
    text = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[4:7]
    at = text.find(stop)
    for include, want in ((False, text[:at]), (True, text[:at + len(stop)])):
        out = client.completions.create(**args, stop=[stop], extra_body={"include_stop_str_in_output": include})
        assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_and_the_stop_token_s_text(client, model, tok, skip):
    """EOS forced by logit_bias: three of them with ignore_eos, or one that stops the answer, whose text
    is kept with include_stop_str_in_output."""
    args = dict(model=model, prompt="a fox", temperature=0, logit_bias={str(tok.eos_id): 100})
    eos = tok.decode([tok.eos_id], skip_special_tokens=False)
    out = client.completions.create(**args, max_tokens=3, extra_body={"ignore_eos": True, "skip_special_tokens": skip})
    assert out.choices[0].text == ("" if skip else eos * 3)
    out = client.completions.create(**args, max_tokens=3, extra_body={
        "include_stop_str_in_output": True, "skip_special_tokens": skip})
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("" if skip else eos, "stop")


def test_chat_echo_prepends_the_message_the_answer_continues(client, model):
    """With add_generation_prompt off the answer continues the last message, which echo puts in front of it;
    a new assistant turn after a user message continues nothing."""
    start = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon"}]
    for messages, echoed, generation_prompt in ((start, "Once upon", False), (start[:1], "", True)):
        args = dict(model=model, messages=messages, temperature=0, max_tokens=6)
        plain = client.chat.completions.create(**args, extra_body={"add_generation_prompt": generation_prompt})
        extra = {"add_generation_prompt": generation_prompt, "echo": True}
        out = client.chat.completions.create(**args, extra_body=extra)
        assert out.choices[0].message.content == echoed + plain.choices[0].message.content
        chunks = client.chat.completions.create(**args, stream=True, extra_body=extra)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content

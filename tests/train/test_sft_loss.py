"""The assistant-only loss on packed multi-turn chat rows: the loss (main and
MTP) equals numpy on HF transformers' own assistant mask, and no target outside the assistant turns
reaches a gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.data import chat
from dsv3_jax.data.tokenizer import BUNDLED_PATH
from dsv3_jax.train import losses
from tests.helpers import shrunk_tiny_config

ROW = 128  # T + 1


@pytest.fixture(scope="module")
def model():
    return DeepSeekV3(shrunk_tiny_config(vocab_size=2048, num_mtp_layers=2, num_routed_experts=8, num_expert_groups=2,
                                         num_groups_per_token=1, num_experts_per_token=2), rngs=nnx.Rngs(5))


@pytest.fixture(scope="module")
def hf_batch():
    """Two packed rows of multi-turn conversations (system and developer turns among them), their
    ids and assistant masks from transformers' apply_chat_template(return_assistant_tokens_mask)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_PATH), bos_token="<|bos|>",
                                              eos_token="<|eos|>", pad_token="<|pad|>")
    hf.chat_template = chat.chat_tokenizer().template
    source = chat.open_chat_source()
    multi = [source[i][0] for i in range(len(source)) if sum(m["role"] == "assistant" for m in source[i][0]) > 1]
    system = [source[i][0] for i in range(len(source)) if source[i][0][0]["role"] in ("system", "developer")]
    batch = {k: np.zeros((2, ROW), np.int32) for k in ("tokens", "segment_ids", "positions", "loss_mask")}
    at, segments = [0, 0], [0, 0]
    for messages in [m for pair in zip(multi[:6], system[:6]) for m in pair]:  # first fit into the 2 rows
        enc = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        n = len(enc["input_ids"])
        r = next((r for r in range(2) if at[r] + n <= ROW), None)
        if r is None:
            continue
        segments[r] += 1
        span = slice(at[r], at[r] + n)
        batch["tokens"][r, span], batch["loss_mask"][r, span] = enc["input_ids"], enc["assistant_masks"]
        batch["segment_ids"][r, span], batch["positions"][r, span] = segments[r], np.arange(n)
        at[r] += n
    assert min(segments) >= 2, segments
    return batch


def _forward(model, batch):
    inputs = batch["tokens"][:, :-1]
    t = inputs.shape[1]
    return model.forward(jnp.asarray(inputs), positions=jnp.asarray(batch["positions"][:, :t]),
                         segment_ids=jnp.asarray(batch["segment_ids"][:, :t]), with_mtp=True)


def numpy_masked_nll(logits_BxTxV, batch, shift):
    """Mean -log p of tokens[j + shift] over the j where it is an assistant token of j's conversation."""
    logits = np.asarray(logits_BxTxV, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    total, count = 0.0, 0
    b, n = batch["tokens"].shape
    for i in range(b):
        for j in range(n - 1):
            k = j + shift
            if k < n and batch["segment_ids"][i, j] > 0 and batch["segment_ids"][i, k] == batch["segment_ids"][i, j] \
                    and batch["loss_mask"][i, k]:
                total -= logp[i, j, batch["tokens"][i, k]]
                count += 1
    return total / count


@pytest.fixture(scope="module")
def loss_and_grads(model, hf_batch):
    """Jitted `(params, targets_batch) -> ((Losses, ModelOutput), parameter gradients)`: the forward
    reads the inputs of `hf_batch`, the loss the targets of `targets_batch` (so a changed token
    changes only what is predicted, not the context). One compile serves both tests."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, rest, targets_batch):
        def loss(params, rest):
            out = _forward(nnx.merge(graphdef, params, rest), hf_batch)
            parts = losses.training_losses(out, targets_batch, mtp_weight=0.3, balance_weight=1e-4)
            return parts.total, (parts, out)
        (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, rest)
        return aux, grads[0]  # both traced alike, as nnx.merge wants

    def with_tokens(tokens):
        batch = {**{k: jnp.asarray(v) for k, v in hf_batch.items()}, "tokens": jnp.asarray(tokens)}
        return run(params, rest, batch)

    return with_tokens


def test_loss_equals_numpy_on_hf_assistant_mask(loss_and_grads, hf_batch):
    (parts, out), _ = loss_and_grads(hf_batch["tokens"])
    np.testing.assert_allclose(parts.lm, numpy_masked_nll(out.logits, hf_batch, 1), rtol=1e-5)
    mtp = np.mean([numpy_masked_nll(out.mtp_logits[k], hf_batch, k + 2) for k in range(2)])
    np.testing.assert_allclose(parts.mtp, mtp, rtol=1e-5)
    every_token = dict(hf_batch, loss_mask=(hf_batch["segment_ids"] > 0).astype(np.int32))
    assert abs(float(parts.lm) - numpy_masked_nll(out.logits, every_token, 1)) > 1e-3  # the mask matters


def test_non_assistant_targets_reach_no_gradient(loss_and_grads, hf_batch):
    _, base = loss_and_grads(hf_batch["tokens"])
    rng = np.random.default_rng(0)
    other = hf_batch["tokens"].copy()
    outside = hf_batch["loss_mask"] == 0  # every non-assistant token, padding included
    other[outside] = rng.integers(0, 2048, outside.sum())
    assert (other != hf_batch["tokens"]).sum() > 100
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(loss_and_grads(other)[1])):
        np.testing.assert_array_equal(a, b)
    one = hf_batch["tokens"].copy()  # control: one assistant token changed moves the gradient
    i, j = np.argwhere(hf_batch["loss_mask"] == 1)[3]
    one[i, j] = (one[i, j] + 1) % 2048
    moved = loss_and_grads(one)[1]
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(moved)))

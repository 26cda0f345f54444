"""MTP speculative decoding: greedy output identical to plain greedy; drafts accepted when they must be."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3
from dsv3_jax.inference import SamplingConfig, generate
from dsv3_jax.inference.speculative import accept
from tests.inference.conftest import MAX_NEW, full_forward_greedy, tiny_config


def test_mtp_greedy_equals_plain_greedy(model, ragged_batch, greedy_reference):
    prompts, lengths = ragged_batch
    out, stats = generate(model, prompts, MAX_NEW, lengths=lengths, use_mtp=True, return_stats=True)
    plain = np.asarray(generate(model, prompts, MAX_NEW, lengths=lengths))
    np.testing.assert_array_equal(np.asarray(out), plain)
    assert stats.proposed_drafts > 0 and 1.0 <= stats.tokens_per_forward <= 2.0


def _copying_model():
    """Nearly a bigram model whose MTP depths must agree with it.

    Main model: FFN outputs zeroed and attention scaled down, so h_i ~ norm(Emb(t_i)) and the next
    token is (mostly) a function of the current one. MTP depth k: its block is switched off and
    eh_proj = [I; 0] passes enorm(Emb(t_{i+k})) (enorm weight 1), then its norm uses the main
    model's norm weight: h^k_i ~ norm(Emb(t_{i+k})), the main model's own guess one step further.
    """
    cfg = tiny_config(num_mtp_layers=2)
    m = DeepSeekV3(cfg, rngs=nnx.Rngs(1))
    d = cfg.hidden_size
    for blocks in (m.dense_layers, m.moe_layers):
        blocks.attn.wo[...] = 0.003 * blocks.attn.wo[...]
    m.dense_layers.ffn.w2[...] = jnp.zeros_like(m.dense_layers.ffn.w2[...])
    for ffn in (m.moe_layers.ffn, m.mtp.block.ffn):
        ffn.w2[...] = jnp.zeros_like(ffn.w2[...])
        ffn.shared_experts.w2[...] = jnp.zeros_like(ffn.shared_experts.w2[...])
    m.mtp.block.attn.wo[...] = jnp.zeros_like(m.mtp.block.attn.wo[...])
    eye = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    m.mtp.eh_proj[...] = jnp.broadcast_to(eye, m.mtp.eh_proj[...].shape)
    m.mtp.enorm.weight[...] = jnp.ones_like(m.mtp.enorm.weight[...])
    m.mtp.norm.weight[...] = jnp.broadcast_to(m.norm.weight[...], m.mtp.norm.weight[...].shape)
    return m


def test_mtp_drafts_accepted_when_they_must_agree(ragged_batch):
    m = _copying_model()
    prompts, lengths = np.abs(ragged_batch[0]), ragged_batch[1]
    expected, gap = full_forward_greedy(m, prompts, lengths, MAX_NEW)
    assert gap > 1e-3
    out, stats = generate(m, prompts, MAX_NEW, lengths=lengths, use_mtp=True, return_stats=True)
    out = np.asarray(out)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(out[b, :n + MAX_NEW], expected[b, :n + MAX_NEW], err_msg=f"row {b}")
    assert stats.acceptance_rate > 0.5, stats
    assert stats.tokens_per_forward > 2.0, stats  # 2 drafts per step: up to 3 tokens per forward
    assert stats.forwards < MAX_NEW - 1


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.7, top_k=4, top_p=0.9)])
def test_speculative_acceptance_keeps_the_target_distribution(sampling):
    """Emitted token 0 must follow p_0 whatever the (deterministic) draft: accept d w.p. p_0(d),
    else draw from p_0 without d."""
    logits = jax.random.normal(jax.random.key(0), (1, 3, 12)) * 1.5
    drafts = jnp.array([[int(jnp.argsort(logits[0, 0])[-2]), 3]], jnp.int32)  # a likely but not top draft
    keys = jax.random.split(jax.random.key(1), 20000)
    emitted, accepted = jax.jit(jax.vmap(lambda k: accept(logits, drafts, sampling.draw_with(k, 1))))(keys)
    freq = np.bincount(np.asarray(emitted[:, 0, 0]), minlength=12) / len(keys)
    x = np.asarray(logits[0, 0], np.float64) / sampling.temperature
    keep = np.ones(12, bool)
    if sampling.top_k:
        keep &= x >= np.sort(x)[-sampling.top_k]
    p = np.where(keep, np.exp(x - x.max()), 0)
    p /= p.sum()
    if sampling.top_p:
        order = np.argsort(-p)
        in_nucleus = (np.cumsum(p[order]) - p[order]) < sampling.top_p
        p[order[~in_nucleus]] = 0
        p /= p.sum()
    np.testing.assert_allclose(freq, p, atol=0.015)
    assert 0 < np.mean(np.asarray(accepted) > 0) < 1

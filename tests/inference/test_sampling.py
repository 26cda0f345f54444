"""Sampling: support within numpy's top-k set / top-p nucleus; reproducible for a seed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv3_jax.inference import SamplingConfig, generate
from dsv3_jax.inference.sampling import draw
from tests.inference.conftest import VOCAB


def numpy_support(logits_BxV: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """bool [B, V]: top-k of logits / T, then the smallest set of most likely tokens reaching top_p."""
    x = logits_BxV.astype(np.float64) / cfg.temperature
    keep = np.ones_like(x, bool)
    if cfg.top_k:
        keep &= x >= np.sort(x, axis=-1)[:, -cfg.top_k:][:, :1]
    if cfg.top_p:
        for b in range(len(x)):
            p = np.where(keep[b], np.exp(x[b] - x[b].max()), 0)
            p /= p.sum()
            order = np.argsort(-p)
            before = np.cumsum(p[order]) - p[order]
            keep[b, order[before >= cfg.top_p]] = False
    return keep


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0, top_k=5), SamplingConfig(0.8, top_p=0.6),
                                 SamplingConfig(1.3, top_k=10, top_p=0.8)])
def test_samples_stay_in_numpy_support(cfg):
    logits = np.asarray(jax.random.normal(jax.random.key(0), (6, 48))) * 2
    keys = jax.random.split(jax.random.key(1), 3000)
    tokens = np.asarray(jax.jit(jax.vmap(lambda k: draw(jnp.asarray(logits), cfg.draw_with(k, 6))))(keys))  # [N, B]
    support = numpy_support(logits, cfg)
    rows = np.broadcast_to(np.arange(6), tokens.shape)
    assert support[rows, tokens].all(), "a token outside the top-k / top-p set was sampled"
    seen = np.zeros_like(support)
    seen[rows, tokens] = True
    assert (seen == support).all(), "every token of the support should appear in 3000 draws"


def test_greedy_is_argmax_and_bad_settings_are_named():
    logits = jax.random.normal(jax.random.key(2), (4, 32))
    np.testing.assert_array_equal(draw(logits, SamplingConfig().draw_with(jax.random.key(0), 4)), np.argmax(logits, -1))
    for kw, field in [(dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=1.5), "top_p")]:
        with pytest.raises(ValueError, match=field):
            SamplingConfig(**kw)


def test_generate_sampling_reproducible_and_within_top_k(model, ragged_batch):
    prompts, lengths = np.abs(ragged_batch[0]), ragged_batch[1]
    kw = dict(temperature=1.0, top_k=3, lengths=lengths)
    a = np.asarray(generate(model, prompts, 6, seed=3, **kw))
    np.testing.assert_array_equal(a, np.asarray(generate(model, prompts, 6, seed=3, **kw)))
    assert not np.array_equal(a, np.asarray(generate(model, prompts, 6, seed=4, **kw)))
    graphdef, state = nnx.split(model)
    logits = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(a)))  # causal
    top3 = np.argsort(logits, axis=-1)[..., -3:]
    for b, n in enumerate(lengths):
        for j in range(n, n + 6):
            assert a[b, j] in top3[b, j - 1], f"row {b} position {j}: {a[b, j]} not in top-3 {top3[b, j - 1]}"
    assert a.max() < VOCAB

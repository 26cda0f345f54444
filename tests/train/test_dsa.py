"""Training DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2 report): its KL loss
against numpy, the dense warm-up (only the indexer learns, its KL falls, every other weight stays
bit-equal), the sparse stage's gradients (the indexer's input detached), and `--init_from` a run
without an indexer (the indexer drawn by the model's init, the rest the run's)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import DeepSeekV3, load_pretrained
from dsv3_jax.model.attention import MLA
from dsv3_jax.model.indexer import indexer_kl
from dsv3_jax.model.rope import rope_angles
from dsv3_jax.train import optimizer, state as state_lib, step as step_lib

T = 32  # the session run's sequence length (tests/train/conftest.py)
INDEXER = dict(index_n_heads=2, index_head_dim=16)
OPT = ml_collections.ConfigDict(dict(schedule="wsd", peak_lr=1e-2, end_lr=1e-2, warmup_steps=0, decay_fraction=0.0,
                                     b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0))


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _batch(vocab: int, seed: int = 0, b: int = 4) -> dict:
    seg = np.ones((b, T + 1), np.int32)
    seg[:, 20:] = 2  # two documents a row: the indexer sees the same-document keys only
    pos = np.where(seg == 2, np.arange(T + 1) - 20, np.arange(T + 1)).astype(np.int32)
    return {"tokens": np.random.default_rng(seed).integers(3, vocab, (b, T + 1)).astype(np.int32),
            "segment_ids": seg, "positions": pos}


def test_indexer_kl_against_numpy():
    """KL(p || q) over each query's selected keys (p: head-summed probabilities L1-normalised, q:
    softmax of the logits over those keys), a mean over the masked queries; 0 when q = p."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    selected = rng.random((2, 5, 7)) < 0.6
    selected[..., 0] = True
    probs = np.where(selected, rng.random((2, 5, 7)), 0.0).astype(np.float32) * 3  # rows sum to ~H
    mask = np.array([[1, 1, 1, 0, 1], [1, 0, 1, 1, 1]], bool)
    p = probs / probs.sum(-1, keepdims=True)
    q = np.where(selected, np.exp(logits), 0.0)
    q /= q.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(p > 0, p * np.log(p / q), 0.0).sum(-1)
    want = kl[mask].mean()
    np.testing.assert_allclose(float(indexer_kl(logits, probs, selected, mask)), want, rtol=1e-5)
    assert abs(float(indexer_kl(np.log(np.where(selected, p, 1e-30)), probs, selected, None))) < 1e-6


@pytest.fixture(scope="module")
def warm(trained_run):
    """The session's V3.1-shaped run (no indexer) loaded with a dense indexer (index_topk = T)."""
    return load_pretrained(str(trained_run), index_topk=T, **INDEXER)


def test_init_from_a_run_without_indexer(trained_run, warm):
    """The run's leaves as they are; the indexers' as the model's init draws them (under jit: to the
    last bit or so of the eager draw)."""
    run, fresh = _flat(nnx.to_pure_dict(nnx.state(load_pretrained(str(trained_run))))), DeepSeekV3(warm.config)
    want = _flat(nnx.to_pure_dict(nnx.state(fresh)))
    got = _flat(nnx.to_pure_dict(nnx.state(warm)))
    assert sum("indexer" in k for k in got) == 15 and set(got) - set(run) == {k for k in got if "indexer" in k}
    for key, value in got.items():
        if "indexer" in key:
            np.testing.assert_allclose(value, want[key], rtol=1e-6, atol=1e-9, err_msg=key)
        else:
            np.testing.assert_array_equal(value, run[key], err_msg=key)


def test_dense_warmup_trains_the_indexer_alone(warm):
    """Only the indexers' parameters are differentiated and updated: their KL to the main
    attention falls while every other parameter and the router biases stay bit-equal."""
    model = nnx.clone(warm)
    _, params, _ = state_lib.split_model(model)
    trainable = optimizer.trainable_mask(params, "indexer")
    tx = optimizer.make_optimizer(OPT, 10, optimizer.select(optimizer.decay_mask(params), trainable))
    graphdef, state = state_lib.init_train_state(model, tx, seed=0, trainable=trainable)
    before = _flat((state.params, state.router_bias))
    step = step_lib.make_train_step(graphdef, tx, optimizer.make_schedule(OPT, 10), mtp_weight=0.3,
                                    balance_weight=1e-4, bias_update_speed=0.0, trainable=trainable,
                                    indexer_weight=1.0)
    batch, kls = _batch(warm.config.vocab_size), []
    for _ in range(20):  # the KL's descent is slow, then steep: 10 steps sat on the slope under jax 0.12
        state, metrics = step(state, batch)
        kls.append(float(metrics["indexer_loss"]))
    assert kls[-1] < 0.7 * kls[0], kls
    after = _flat((state.params, state.router_bias))
    for key, value in before.items():
        if "indexer" in key:
            assert not np.array_equal(value, after[key]), key
        else:
            np.testing.assert_array_equal(value, after[key], err_msg=key)


def test_sparse_stage_gradients(warm):
    """index_topk = T/4: an MLA layer's output reaches every weight but the indexer's and its input;
    the indexer's KL (its input detached, the target fixed) the indexer's weights only."""
    cfg = warm.config.replace(index_topk=T // 4)
    graphdef, weights = nnx.split(MLA(cfg, rngs=nnx.Rngs(0)))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, T, cfg.hidden_size)), jnp.float32)
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(T), (2, T)), cfg)
    probe = jnp.asarray(np.random.default_rng(3).normal(size=(2, T, cfg.hidden_size)), jnp.float32)

    def loss(w, x, which):
        out, terms = nnx.merge(graphdef, w).expanded(x, cos, sin, indexer_terms=True)
        return jnp.sum(out * probe) if which == "out" else indexer_kl(*terms, None)

    grads = jax.jit(lambda w, x: {which: jax.grad(loss, (0, 1))(w, x, which) for which in ("out", "kl")})(weights, x)
    out_w, kl_w = _flat(nnx.to_pure_dict(grads["out"][0])), _flat(nnx.to_pure_dict(grads["kl"][0]))
    assert sum("indexer" in k for k in out_w) == 5
    for key in out_w:
        reaches = (bool(np.any(out_w[key] != 0)), bool(np.any(kl_w[key] != 0)))
        assert reaches == ((False, True) if "indexer" in key else (True, False)), key
    assert np.any(np.asarray(grads["out"][1]) != 0) and not np.any(np.asarray(grads["kl"][1]) != 0)

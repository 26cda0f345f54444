"""YaRN past original_max_position_embeddings: logits at twice the original length against HF
transformers (fp32, the committed YaRN fixtures' weights), through the training forward and through
chunked prefill over the latent cache."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import load_pretrained
from dsv3_jax.inference import init_cache

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "parity")
TOL = 1e-4
CHUNK = 64


def _rel(ours, ref):
    return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


def _chunked_logits(model, tokens):
    graphdef, state = nnx.split(model)
    b, t = tokens.shape

    @jax.jit
    def chunk(state, cache, piece, start):
        positions = start + np.broadcast_to(np.arange(CHUNK, dtype=np.int32), (b, CHUNK))
        out = nnx.merge(graphdef, state).forward(piece, positions=positions, with_mtp=False, cache=cache)
        return out.logits, out.cache

    cache, logits = init_cache(model.config, b, t, "float32"), []
    for start in range(0, t, CHUNK):
        out, cache = chunk(state, cache, tokens[:, start:start + CHUNK], np.int32(start))
        logits.append(np.asarray(out))
    return np.concatenate(logits, axis=1)


@pytest.mark.parametrize("name", ["lora_groups_yarn", "yarn_mscale_halves"])
def test_yarn_at_twice_the_original_length_matches_hf(name):
    torch = pytest.importorskip("torch")
    import transformers

    folder = os.path.join(FIXTURES, name)
    model = load_pretrained(folder)
    yarn = model.config.yarn
    length = 2 * yarn.original_max_position_embeddings
    assert length <= model.config.max_position_embeddings
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, length)).astype(np.int32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert np.max(np.abs(ref)) > 1.0
    assert _rel(model(tokens), ref) <= TOL
    late = slice(yarn.original_max_position_embeddings, None)  # the positions YaRN exists for
    assert _rel(_chunked_logits(model, tokens)[:, late], ref[:, late]) <= TOL

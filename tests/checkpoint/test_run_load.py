"""`load_pretrained(run, weights=...)`: a training run's projections are quantized per shard from
windows of its train state (through the run's one reader, never restored dense first), and equal
bit for bit what quantizing the restored model in memory gives (`quantize_model`)."""

import jax
import numpy as np
from flax import nnx

from dsv3_jax import load_pretrained
from dsv3_jax.checkpoint import load
from dsv3_jax.model import quant as model_quant


def test_a_run_loads_quantized_per_shard_as_quantize_model_quantizes_it(trained_run, monkeypatch):
    restored = []
    restore = load.restore_variables

    def recording_restore(item, variables, keys, *args, **kwargs):
        restored.extend(keys)
        return restore(item, variables, keys, *args, **kwargs)

    monkeypatch.setattr(load, "restore_variables", recording_restore)
    for fmt in ("int8", "int4", "fp8"):
        restored.clear()
        model = load_pretrained(trained_run, weights=fmt)
        quantized = {tuple(str(p) for p in path) for path, node in nnx.iter_graph(model)
                     if isinstance(node, model_quant.QuantizedWeight)}
        assert quantized and restored and not quantized & set(restored), fmt  # none of them restored dense
        reference = model_quant.quantize_model(load_pretrained(trained_run), fmt)
        got, want = jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reference))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            a, b = np.asarray(a), np.asarray(b)
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), fmt

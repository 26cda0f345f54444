"""The one HF reader: any shard of any parameter read alone equals the same slice of the whole
parameter, whose every slice `slice_to_hf` turns back into the HF tensor as stored (dequantised);
FP8 windows dequantise like the whole tensor; the converter's blocks stay under its chunk bound at
the released shapes."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.checkpoint import fp8, hf_names
from dsv3_jax.checkpoint.hf_reader import HFReader, read_shard
from dsv3_jax.checkpoint.hf_to_orbax import CHUNK_BYTES, LeafPlan, fp8_regions, regions
from dsv3_jax.checkpoint.load import abstract_model
from benchmarks.make_released_shapes import released_config


def _whole(reader: HFReader, leaf, shape) -> np.ndarray:
    """The whole parameter, read at once; each slice of it back in HF layout equals the stored tensor."""
    whole = read_shard(leaf, shape, (), reader.leaf_window(leaf, np.float32), np.float32)
    for index, (name,) in hf_names.leaf_slices(leaf):
        np.testing.assert_array_equal(hf_names.slice_to_hf(leaf, whole[index]), reader.window(name), err_msg=name)
    return whole


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_any_shard_equals_the_slice_of_the_whole(hf_folders, kind):
    reader = HFReader(hf_folders[kind])
    cfg = reader.config()
    variables = abstract_model(cfg)[1]
    rng = np.random.default_rng(0)
    for leaf in hf_names.leaves(cfg):
        shape = tuple(variables[leaf.path].shape)
        whole = _whole(reader, leaf, shape)
        window = reader.leaf_window(leaf, np.float32)
        for _ in range(4):
            index = []
            for n in shape:
                a = int(rng.integers(0, n))
                index.append(slice(a, int(rng.integers(a + 1, n + 1))))
            got = read_shard(leaf, shape, tuple(index), window, np.float32)
            np.testing.assert_array_equal(got, whole[tuple(index)], err_msg=f"{leaf.path} {index}")


def test_fp8_window_dequantises_like_the_whole_tensor():
    rng = np.random.default_rng(1)
    q, s = fp8.quantize(rng.standard_normal((300, 530)).astype(np.float32))
    whole = fp8.dequantize(q, s)
    for rows, cols in [(slice(0, 300), slice(0, 530)), (slice(100, 257), slice(129, 400)), (slice(5, 6), slice(500, 530))]:
        rs, cs = fp8.scale_window(rows, cols)
        got = fp8.dequantize(q[rows, cols], s[rs, cs], row0=rows.start, col0=cols.start)
        np.testing.assert_array_equal(got, whole[rows, cols])
        # the bounded form: row blocks of 128 rows (the scratch holds 128 rows of float32), each
        # reading its scale rows once, rounded once into the target dtype
        reads = []

        def read_s(r, c):
            reads.append(r)
            return s[r, c]

        got = fp8.dequantize_window(lambda r, c: q[r, c], read_s, rows, cols, jnp.bfloat16,
                                    scratch_bytes=4 * (cols.stop - cols.start) * 128)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, whole[rows, cols].astype(jnp.bfloat16))
        scale_rows = [i for r in reads for i in range(r.start, r.stop)]
        assert scale_rows == list(range(rs.start, rs.stop)), (rows, reads)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_converter_blocks_tile_every_leaf_under_the_chunk_bound(dtype):
    """At the released shapes (embedding and head 129280 x 7168) every written block, and every
    kept-FP8 block, is at most CHUNK_BYTES, and the blocks cover each array exactly once."""
    cfg = released_config(16).replace(param_dtype=dtype)
    variables = abstract_model(cfg)[1]
    for leaf in hf_names.leaves(cfg):
        var = variables[leaf.path]
        p = LeafPlan(leaf, tuple(var.shape), np.dtype(jnp.dtype(var.dtype)), False, dtype, 0,
                     tuple(leaf.hf_shapes()[0]))
        cases = [(p.shape, p.dtype.itemsize, regions(p))]
        if fp8.quantizable(leaf.hf(leaf.hf_layers[0] if leaf.hf_layers else None)[0]):
            cases.append((p.shape[:p.stacked] + p.hf_shape, 1, fp8_regions(p)))
        for shape, itemsize, (_, blocks) in cases:
            sizes = [math.prod(len(range(*s.indices(n))) for s, n in zip(b, shape)) for b in blocks]
            assert max(sizes) * itemsize <= CHUNK_BYTES, (leaf.path, max(sizes) * itemsize)
            assert sum(sizes) == math.prod(shape), leaf.path

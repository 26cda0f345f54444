"""load_pretrained across processes, at test size: two processes x 4 fake
CPU devices (jax.distributed on 127.0.0.1) load an HF folder, bf16 and FP8 with block scales, onto
an fsdp=2 x expert=4 mesh. Every parameter has the sharding of the rules table training uses, the
logits equal the unsharded load, and each process reads (counted at the reader) well under the
bytes of the whole model: only its own devices' shards. The 1 GB peak-RSS figures come from
`python -m benchmarks.bench_load`, which runs these same workers."""

import numpy as np
import pytest

from dsv3_jax.checkpoint import hf_names
from benchmarks.bench_load import run_load
from tests.checkpoint.conftest import tiny_cfg
from tests.sharding import workers


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_two_processes_read_only_their_shards(hf_folders, tmp_path, kind):
    env = workers.fake_device_env()
    one = run_load(hf_folders[kind], str(tmp_path / "one"), "unsharded", env, timeout=600, dtype="float32")[0]
    two = run_load(hf_folders[kind], str(tmp_path / "two"), "two", env, timeout=600, dtype="float32")
    ref = np.load(tmp_path / "one.0.npy")
    for r in two:
        assert r["local_devices"] == 4
        assert r["shardings_checked"] == len(hf_names.leaves(tiny_cfg()))  # every parameter, against the rules
        assert r["bytes_read"] < 0.6 * one["bytes_read"], (r, one)
        np.testing.assert_allclose(np.load(tmp_path / f"two.{r['process']}.npy"), ref, rtol=1e-4, atol=1e-4)
    assert {r["process"] for r in two} == {0, 1}

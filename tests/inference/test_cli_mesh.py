"""`python -m experiments.generate --mesh ...` loads the weights onto a device mesh (4 fake CPU
devices) shard by shard; greedy decoding, on a paged cache split over the batch shards, gives the
text of the single-device load (slot cache). The model is V3.2's (the lightning indexer keeping 4
entries a query), so the paged reads of both attention forms run on the mesh: prompt chunks of 4,
the first one dense, the later ones and the decode steps sparse."""

import re
import subprocess
import sys

from benchmarks.make_synthetic_checkpoint import make_checkpoint
from dsv3_jax.config import ModelConfig
from tests.inference.test_cli import HF_DIR, ROOT, char_tokenizer
from tests.sharding import workers


def _generate(checkpoint, tok, devices: int, *flags) -> list[str]:
    env = workers.fake_device_env(devices)
    cmd = [sys.executable, "-m", "experiments.generate", f"--checkpoint={checkpoint}", f"--tokenizer={tok}",
           "--prompt=hello world", "--max_new_tokens=6", "--cache_dtype=float32", "--dtype=float32", *flags]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.splitlines()


def test_mesh_load_generates_the_same_text(tmp_path):
    """... and counts the same tokens: not the rows that pad the one prompt to the mesh's 4 shards."""
    tok, v32 = char_tokenizer(tmp_path / "tokenizer.json"), tmp_path / "v32"
    cfg = ModelConfig.from_hf_config(HF_DIR).replace(index_n_heads=2, index_head_dim=16, index_topk=4)
    make_checkpoint(cfg, v32, dtype="float32", seed=0)  # HF_DIR's model (MoE, grouped routing, YaRN) as V3.2
    mesh = _generate(v32, tok, 4, "--mesh=fsdp=2,expert=2", "--page_size=4", "--prefill_chunk=4")
    alone = _generate(v32, tok, 1, "--prefill_chunk=4")
    assert mesh[0] == alone[0]
    timed = [int(re.search(r"then (\d+) tokens in", "\n".join(out)).group(1)) for out in (mesh, alone)]
    assert timed[0] == timed[1] > 0, timed


def test_bad_mesh_flag_is_a_usage_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "experiments.generate", f"--checkpoint={HF_DIR}", "--prompt=x",
                          "--mesh=fsdp2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "expected AXIS=N" in res.stderr, res.stderr[-2000:]

"""`python -m experiments.generate --mesh ...` loads the weights onto a device mesh (4 fake CPU
devices) shard by shard; greedy decoding, on a paged cache split over the batch shards, gives the
text of the single-device load (slot cache)."""

import re
import subprocess
import sys

from tests.inference.test_cli import HF_DIR, ROOT, char_tokenizer
from tests.sharding import workers


def _generate(tok, devices: int, *flags) -> list[str]:
    env = workers.fake_device_env(devices)
    cmd = [sys.executable, "-m", "experiments.generate", f"--checkpoint={HF_DIR}", f"--tokenizer={tok}",
           "--prompt=hello world", "--max_new_tokens=6", "--cache_dtype=float32", "--dtype=float32", *flags]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.splitlines()


def test_mesh_load_generates_the_same_text(tmp_path):
    """... and counts the same tokens: not the rows that pad the one prompt to the mesh's 4 shards."""
    tok = char_tokenizer(tmp_path / "tokenizer.json")
    mesh, alone = _generate(tok, 4, "--mesh=fsdp=2,expert=2", "--page_size=4"), _generate(tok, 1)
    assert mesh[0] == alone[0]
    timed = [int(re.search(r"then (\d+) tokens in", "\n".join(out)).group(1)) for out in (mesh, alone)]
    assert timed[0] == timed[1] > 0, timed


def test_bad_mesh_flag_is_a_usage_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "experiments.generate", f"--checkpoint={HF_DIR}", "--prompt=x",
                          "--mesh=fsdp2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "expected AXIS=N" in res.stderr, res.stderr[-2000:]

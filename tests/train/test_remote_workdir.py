"""A run whose work directory is `gs://bucket/run`, against a local GCS emulator:
`experiments.train` trains into the bucket, is SIGKILLed, resumes from the bucket
with the loss curve of an uninterrupted run, and `experiments.generate --checkpoint=gs://bucket/run`
answers from it, through the command lines. The test process reads the bucket over the emulator's
JSON API only.

On an object store (no atomic rename) Orbax writes a step's items first, each with its own
`<step>/<item>/commit_success.txt`, and the step's own `<step>/commit_success.txt` last: only that
one makes the step a checkpoint (Orbax's step discovery and `checkpoint/run_folder.py` agree). A
kill between the two leaves an unfinished step, which the restart ignores and rewrites.
"""

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

from tests.helpers import run
from tests.train.conftest import REPO, STEPS, train_command, train_env

BUCKET, RUN = "bucket", "run"
# Every 10 steps: the emulator serves one request at a time, and a save waits for the one before.
FLAGS = ["--config.train.checkpoint_every=10", "--config.train.eval_every=20"]
COMPARED = ("loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm", "lr")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """(base URL, environment for the CLIs): the emulator on 127.0.0.1, in memory, one bucket. Its
    log goes to a file: it logs every request, and a pipe nobody reads would fill and stall it."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("gcs") / "emulator.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tests.train.gcs_emulator", str(port), BUCKET], cwd=REPO,
                            env=train_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(base + "/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    assert proc.poll() is None, log.seek(0) or log.read()[-3000:]
    env = train_env()
    env.update(STORAGE_EMULATOR_HOST=base,  # gcsfs (epath) and the google client (TensorBoard)
               TENSORSTORE_GCS_HTTP_URL=base,  # tensorstore's documented switch to another server
               GOOGLE_AUTH_TOKEN_FOR_TESTING="test",  # tensorstore: a fixed token, no credential search
               FSSPEC_GCS_TOKEN="anon",  # gcsfs: no credential search
               # gcsfs's default filesystem first asks the storage-control gRPC API for the
               # bucket's kind (60 s timeouts per bucket): GCS has it, the emulator does not.
               GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    yield base, env
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _objects(base: str, prefix: str) -> list[str]:
    query = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{base}/storage/v1/b/{BUCKET}/o?{query}", timeout=10) as r:
        return [item["name"] for item in json.load(r).get("items", [])]


def _read(base: str, name: str) -> str:
    url = f"{base}/download/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    except urllib.error.HTTPError:
        return ""


def _finished_steps(base: str) -> set[int]:
    """Steps whose checkpoint Orbax finalized: `run/checkpoints/<step>/commit_success.txt`, written
    after every item's own marker (`<step>/state/commit_success.txt` alone is not a checkpoint)."""
    names = [n.split("/") for n in _objects(base, f"{RUN}/checkpoints/")]
    return {int(n[2]) for n in names if len(n) == 4 and n[2].isdigit() and n[3] == "commit_success.txt"}


def _records(base: str) -> list[dict]:
    return [json.loads(line) for line in _read(base, f"{RUN}/metrics.jsonl").splitlines() if line.strip()]


def _steps(base: str) -> list[int]:
    return [r["step"] for r in _records(base)]


def _kill_after_a_checkpoint(cmd, env, base: str) -> int:
    """Starts `cmd`, SIGKILLs it once a step is finalized in the bucket; returns that step."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not _finished_steps(base):
        time.sleep(0.1)
    assert proc.poll() is None, f"the run ended before a checkpoint: {proc.stderr.read()[-3000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return max(_finished_steps(base))


def test_gs_run_trains_is_killed_resumes_and_generate_answers(emulator, compile_cache, uninterrupted):
    base, env = emulator
    _, reference, _ = uninterrupted  # the same run on a local disk, never interrupted
    url = f"gs://{BUCKET}/{RUN}"
    cmd = train_command(url, *FLAGS, cache_dir=compile_cache)
    saved = _kill_after_a_checkpoint(cmd, env, base)
    assert saved < STEPS

    result = run(cmd, env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {url}/checkpoints at step {saved}" in result.stderr, result.stderr[-3000:]
    records = _records(base)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, want in zip(records, reference):
        for key in COMPARED:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=f"step {got['step']} {key}")
    assert max(_finished_steps(base)) == STEPS
    assert not _objects(base, "gs:")  # nothing written under a local-path misreading of the URL
    for name in ("config.json", "model_config.json"):
        assert json.loads(_read(base, f"{RUN}/{name}"))
    assert _objects(base, f"{RUN}/tensorboard/")

    out = run([sys.executable, "-m", "experiments.generate", f"--checkpoint={url}", "--prompt=Once upon a time",
               "--max_new_tokens=4", "--temperature=0"], env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"[{url} at step {STEPS}]" in out.stderr, out.stderr[-3000:]
    assert out.stdout.startswith("Once upon a time") and len(out.stdout.strip()) > len("Once upon a time"), out.stdout

"""One server subprocess (`python -m experiments.serve` on 127.0.0.1, a free port) shared by the
HTTP tests, started from a converted test checkpoint."""

import contextlib
import os
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from tests.helpers import free_port
from tests.serving.checkpoint import make_served_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_BATCH, MAX_SEQ_LEN, MAX_QUEUE = 4, 512, 8  # 512: a tool-call round trip fits (its markers are text)
SCORED_LEN = 128  # the longest sequence a test scores with the reference forward (lm-eval's max_length)


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    return make_served_checkpoint(tmp_path_factory.mktemp("serve"))


@contextlib.contextmanager
def serve_process(checkpoint, log_path, *flags, env=None):
    """`python -m experiments.serve` on `checkpoint` with the shared sizes and `flags`, on a free port;
    yields its base url once /health answers, stops it after the block."""
    port = free_port()
    log = open(log_path, "w+")
    cmd = [sys.executable, "-m", "experiments.serve", f"--checkpoint={checkpoint}", f"--port={port}",
           f"--max_batch={MAX_BATCH}", f"--max_seq_len={MAX_SEQ_LEN}", "--chunk=16", f"--max_queue={MAX_QUEUE}", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                log.seek(0)
                pytest.fail("the server did not start:\n" + log.read()[-3000:])
            time.sleep(0.5)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def server(served_checkpoint, tmp_path_factory):
    """(base url, model name) of a running server; stopped at the end of the session."""
    with serve_process(served_checkpoint, tmp_path_factory.mktemp("serve_log") / "server.log") as url:
        yield url, served_checkpoint.name


@pytest.fixture(scope="session")
def client(server):
    """The official OpenAI client on the shared server."""
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def model(server):
    """The served model's name, as requests give it."""
    return server[1]


@pytest.fixture(scope="session")
def tok(served_checkpoint):
    """The served checkpoint's tokenizer."""
    from dsv3_jax.serving import ChatTokenizer, tokenizer_file

    return ChatTokenizer(tokenizer_file(str(served_checkpoint), None)).tokenizer


@pytest.fixture(scope="session")
def ref(served_checkpoint):
    """The served checkpoint's own full forward (fp32, no cache): the log-probability reference."""
    from tests.serving.reference import full_forward

    return full_forward(served_checkpoint, SCORED_LEN)

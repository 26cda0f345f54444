"""Abusive clients against the shared server (127.0.0.1): a 20 MB body is refused with 413 before it is read
(announced by Content-Length or sent chunked) while /health keeps answering; a long prompt is tokenized off the
event loop; lone surrogates are 400s naming the field; 200 concurrent clients against a queue of 8 get no 5xx and
leave every slot free."""

import concurrent.futures
import http.client
import json
import time
import urllib.parse

import numpy as np

BIG = 20 * 2**20  # bytes: far over the default --max_request_bytes
CLIENTS = 200


def request(url: str, method: str, path: str, body=None, timeout: float = 20, whole: bool = True):
    """(status, JSON answer, seconds until the answer's head) of one request; `body` bytes, or an iterable of
    chunks (sent chunked, without Content-Length). `whole=False`: reads one line of the answer and hangs up."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    start = time.perf_counter()
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"},
                 encode_chunked=body is not None and not isinstance(body, bytes))
    resp = conn.getresponse()
    seconds = time.perf_counter() - start
    out = json.loads(resp.read()) if whole else resp.readline()
    conn.close()
    return resp.status, out, seconds


def post(url: str, path: str, body, **kwargs):
    return request(url, "POST", path, body, **kwargs)


def health_while(url: str, fn):
    """fn()'s result and the latencies (s) of /health polled one after another while fn runs in a thread."""
    latencies = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(fn)
        while not job.done() or not latencies:
            status, _, seconds = request(url, "GET", "/health", timeout=60)
            assert status == 200
            latencies.append(seconds)
        return job.result(), latencies


def big_prompt_body(model: str, n_bytes: int) -> bytes:
    """A completion request whose prompt is `n_bytes` of random lower-case words (no word repeats often enough
    for the tokenizer's cache to shortcut it)."""
    letters = np.random.default_rng(0).integers(ord("a"), ord("z") + 1, n_bytes, dtype=np.uint8)
    letters[::7] = ord(" ")
    return json.dumps({"model": model, "prompt": letters.tobytes().decode(), "max_tokens": 1}).encode()


def test_oversized_body_is_refused_at_once_while_health_answers(server, model):
    body = big_prompt_body(model, BIG)
    (status, out, seconds), health = health_while(server[0], lambda: post(server[0], "/v1/completions", body))
    print(f"20 MB body: {status} in {seconds:.3f}s; /health x{len(health)}, slowest {max(health):.3f}s")
    assert status == 413 and "max_request_bytes" in out["error"]["message"]
    assert seconds < 1 and max(health) < 1


def test_oversized_chunked_body_is_refused(server, model):
    chunks = (b" " * 2**20 for _ in range(BIG // 2**20))
    status, out, seconds = post(server[0], "/v1/completions", chunks)
    print(f"20 MB chunked body: {status} in {seconds:.3f}s")
    assert status == 413 and seconds < 1


def test_long_prompt_does_not_stall_the_event_loop(server, model):
    body = big_prompt_body(model, 2**20)  # under the limit: it is tokenized, then refused as too long
    (status, out, seconds), health = health_while(server[0], lambda: post(server[0], "/v1/completions", body))
    print(f"1 MB prompt: {status} in {seconds:.3f}s; /health x{len(health)}, slowest {max(health):.3f}s")
    assert status == 400 and out["error"]["param"] == "prompt" and "prompt has" in out["error"]["message"]
    assert max(health) < min(1, seconds / 2)  # on the event loop, /health would wait about the whole tokenization


def test_lone_surrogates_are_400s_naming_the_field(server, model):
    escaped = json.dumps({"model": model, "prompt": "x\ud800y", "max_tokens": 2}).encode()  # "x\\ud800y" in JSON
    status, out, _ = post(server[0], "/v1/completions", escaped)
    assert (status, out["error"]["param"]) == (400, "prompt") and "surrogate" in out["error"]["message"]
    raw = (b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "x\xed\xa0\x80y"}]}'
           % model.encode())
    status, out, _ = post(server[0], "/v1/chat/completions", raw)
    assert (status, out["error"]["param"]) == (400, "messages") and "messages.0.content" in out["error"]["message"]


def test_crowd_of_clients_gets_no_5xx_and_frees_every_slot(server, model):
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}

    def one(i: int) -> int:  # every third streams and hangs up after its first line
        stream = i % 3 == 0
        data = json.dumps(body | {"stream": stream}).encode()
        return post(server[0], "/v1/completions", data, timeout=120, whole=not stream)[0]

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        statuses = list(pool.map(one, range(CLIENTS)))
    deadline = time.time() + 10
    while (health := request(server[0], "GET", "/health")[1])["slots_in_use"] or health["queue_length"]:
        assert time.time() < deadline, health
        time.sleep(0.1)
    counts = {s: statuses.count(s) for s in set(statuses)}
    print(f"{CLIENTS} clients: {counts}; after: {health}")
    assert set(statuses) <= {200, 429} and 200 in counts and 429 in counts

"""Bounded soak of a running server: good requests (plain, streaming, chat, sampled, with stop
strings), clients that disconnect mid-stream, and bad requests, from several threads at once.

    python -m tests.serving.soak --url=http://127.0.0.1:8000 --model=NAME [--seconds=60] [--workers=8]

Checks what the issue asks: no 5xx, every slot free at the end, RSS stable (from /metrics). Prints
one line of figures and exits 1 when a check fails. The test suite runs it for 20 s.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import random
import threading
import time
import urllib.parse

BAD_BODIES = [
    b'{"model": "M", "prompt": "unterminated',  # malformed JSON
    b'{"model": "M", "prompt": "hi", "max_tokens": -3}',
    b'{"model": "nope", "prompt": "hi"}',
    b'{"model": "M", "prompt": "hi", "top_p": 0}',
    b'{"model": "M", "prompt": "hi", "temperature": "hot"}',
    b'{"model": "M", "prompt": {"a": 1}}',
    b'{"model": "M", "prompt": "hi", "n": 3}',
    b'{"model": "M", "prompt": [1, 2, 99999999]}',
    b'{"model": "M", "prompt": "hi", "stop_token_ids": [-1]}',
    b'{"model": "M", "messages": []}',
    b'{"model": "M", "prompt": "hi", "max_tokens": 100000}',
    b'[1, 2, 3]',
]


class Client:
    def __init__(self, url: str, model: str):
        u = urllib.parse.urlparse(url)
        self.host, self.port, self.model = u.hostname, u.port, model

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=120)

    def post(self, path: str, body: bytes, *, read_events: int | None = None) -> int:
        """POSTs; returns the status. read_events: read that many SSE lines, then hang up."""
        conn = self._conn()
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if read_events is None:
                resp.read()
            else:
                for _ in range(read_events):
                    if not resp.readline():
                        break
            return resp.status
        finally:
            conn.close()

    def get(self, path: str) -> str:
        conn = self._conn()
        try:
            conn.request("GET", path)
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def gauge(self, name: str) -> float:
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


def one_request(client: Client, rng: random.Random) -> tuple[str, int]:
    kind = rng.choice(["completion", "stream", "chat", "chat_stream", "disconnect", "bad", "bad"])
    sampling = {"max_tokens": rng.randint(1, 40), "temperature": rng.choice([0, 0.7, 1.0]),
                "top_p": rng.choice([1.0, 0.9]), "top_k": rng.choice([0, 20]), "seed": rng.randint(0, 99),
                "stop": rng.choice([None, ["e"], ["the", "\n"]])}
    prompt = " ".join(rng.choice(["once", "upon", "a", "time", "there", "was", "fox"]) for _ in range(rng.randint(1, 30)))
    if kind == "bad":
        return kind, client.post("/v1/completions", rng.choice(BAD_BODIES).replace(b'"M"', json.dumps(client.model).encode()))
    if kind.startswith("chat"):
        body = {"model": client.model, "messages": [{"role": "user", "content": prompt}], **sampling}
        path = "/v1/chat/completions"
    else:
        body = {"model": client.model, "prompt": prompt, **sampling}
        path = "/v1/completions"
    body["stream"] = kind in ("stream", "chat_stream", "disconnect")
    if kind == "disconnect":
        body["max_tokens"] = 80 if rng.random() < 0.5 else 40  # long enough to be cut mid-stream
        return kind, client.post(path, json.dumps(body).encode(), read_events=rng.randint(0, 6))
    return kind, client.post(path, json.dumps(body).encode())


def soak(url: str, model: str, seconds: float, workers: int = 8, seed: int = 0) -> dict:
    client = Client(url, model)
    codes: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    errors: list[str] = []
    lock = threading.Lock()
    end = time.time() + seconds
    rss_start = client.gauge("process_resident_memory_bytes")

    def worker(i: int):
        rng = random.Random(seed * 1000 + i)
        while time.time() < end:
            try:
                kind, status = one_request(client, rng)
            except Exception as e:  # a transport error is a server failure too
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                codes[status] += 1
                kinds[kind] += 1

    def sample_rss():
        nonlocal rss_mid
        time.sleep(seconds / 3)
        rss_mid = client.gauge("process_resident_memory_bytes")

    rss_mid = rss_start
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    threads.append(threading.Thread(target=sample_rss))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 30  # disconnects are noticed within a step; queued work drains
    while client.gauge("dsv3_slots_in_use") + client.gauge("dsv3_queue_length") > 0 and time.time() < deadline:
        time.sleep(0.1)
    return {"requests": sum(codes.values()), "codes": dict(codes), "kinds": dict(kinds), "errors": errors,
            "slots_in_use": client.gauge("dsv3_slots_in_use"), "queue_length": client.gauge("dsv3_queue_length"),
            "rss_start_mb": rss_start / 2**20, "rss_mid_mb": rss_mid / 2**20,
            "rss_end_mb": client.gauge("process_resident_memory_bytes") / 2**20,
            "generated_tokens": client.gauge("dsv3_generated_tokens_total")}


def failures(report: dict, rss_growth_mb: float = 64.0) -> list[str]:
    out = [f"{n} responses with status {c}" for c, n in report["codes"].items() if c >= 500]
    out += [f"transport errors: {report['errors'][:3]}"] if report["errors"] else []
    out += [f"slots still in use: {report['slots_in_use']}"] if report["slots_in_use"] else []
    out += [f"requests still queued: {report['queue_length']}"] if report["queue_length"] else []
    growth = report["rss_end_mb"] - report["rss_mid_mb"]
    out += [f"RSS grew {growth:.0f} MB after warm-up"] if growth > rss_growth_mb else []
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--workers", type=int, default=8)
    args = p.parse_args()
    report = soak(args.url, args.model, args.seconds, args.workers)
    print(json.dumps(report))
    bad = failures(report)
    print("FAIL: " + "; ".join(bad) if bad else "OK")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

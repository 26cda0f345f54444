"""Serving throughput and time-to-first-token at concurrency 1, 4 and 16, against sequential generate().

    python -m benchmarks.bench_serve [--checkpoint=CKPT] [--requests=16] [--max_tokens=64] [--max_batch=16] \
        [--concurrency=1,4,16] [--expert_cache=C]
    python -m benchmarks.bench_serve --mode=prefix [--prefix=1024] [--requests=16] [--page_size=64]
    python -m benchmarks.bench_serve --mode=grammar [--requests=16] [--max_tokens=64] [--concurrency=1,4,16]
    python -m benchmarks.bench_serve --mode=memory [--requests=48] [--long_every=16] [--max_tokens=16] \
        [--max_seq_len=1024] [--budget_slots=4] [--page_size=16] [--max_batch=32]

Without --checkpoint it writes a small random model (3 layers, hidden 256, 16 experts of 128, fp32,
the bundled tokenizer's 2048 ids) and converts it, as a user would. One run measures, side by
side: sequential `generate()` calls on the same prompts (each shape compiled before timing), then
`experiments.serve` in a subprocess driven over HTTP with streaming, `c` clients each sending
requests back to back. Output tokens/s = completion tokens / wall time; TTFT = request sent to
first streamed token; decode step = the engine's mean step time (from /metrics). Every figure is a
ratio to concurrency 1 of the same run; a lone request's speed (server at concurrency 1) is also
compared with sequential generate() (target: within 1.3x). With --expert_cache=C both offload the
routed experts behind a device cache of C per layer, and each server row adds the cache's hit rate,
bytes moved per output token and stall time over that row (from /metrics).

--mode=prefix: --requests prompts share a --prefix-token prefix, each with its own 16-token
suffix, sent one after another (greedy, 8 tokens each) with the server's prefix cache off (the
request field `prefix_cache: false`) and then on (the prompts' shared pages, in pages of
--page_size, default the server's); prints TTFT p50 of each, their ratio (target >= 3x) and whether
the outputs are identical.

--mode=grammar: structured outputs' cost per token. At each concurrency the same prompts run free
and under a JSON schema (`guided_json`: an array of at least --max_tokens integers, so every request
runs its --max_tokens tokens either way), alternating free / constrained twice on one server; prints
ms per output token and the decode step of each, and their ratio constrained / free.

--mode=memory: one page pool of a cache budget (--budget_slots x --max_seq_len tokens, in pages of
--page_size: --max_cache_tokens) served by --budget_slots slots, a context per slot as a cache
reserving every slot's longest context holds (the server's pool on a device that reports no memory,
CPU, and the slot cache the server once had), against the same pool shared by --max_batch slots, on
a mixed-length trace: --requests prompts, every --long_every-th near the context limit (--max_seq_len
- --max_tokens - 8 tokens), the others 16-40 tokens, each generating --max_tokens (greedy), sent
50 ms apart in that order. While each runs, /metrics is read every
0.1 s (dsv3_requests_running, dsv3_cache_tokens_used / _total, dsv3_preemptions_total) beside the
tokens the running requests hold as the client sees them (a streaming request: its prompt and the
tokens it has received; of the requests sent and not yet streaming, the first ones up to the
running count, as admission is first come first served: their prompts). Prints each setup's peak
concurrent requests and the shared/per-slot ratio (target >= 4x), and the shared pool's tokens in use
against the tokens held: used - held per running request must stay within one page (a request's
pages round its tokens up, and a decoding request holds the slot of the token it feeds next), checked
on the samples before any preemption (a preempted request waits although its client has tokens).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from absl import flags

from dsv3_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(folder: str) -> str:
    from dsv3_jax.convert import main as convert
    from benchmarks.make_synthetic_checkpoint import bench_config, make_checkpoint

    cfg = bench_config(3, vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                       num_routed_experts=16, num_expert_groups=4, num_mtp_layers=0, param_dtype="float32",
                       compute_dtype="float32", max_position_embeddings=2048)
    make_checkpoint(cfg, os.path.join(folder, "hf"), dtype="float32", seed=0)
    out = os.path.join(folder, "bench-model")
    if convert(["--no-progress", "--hf-dir", os.path.join(folder, "hf"), "--out", out]) != 0:
        raise SystemExit("conversion failed")
    return out


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of four lengths (generate() compiles its prefill per length)."""
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, 2048, (11, 23, 39, 55)[i % 4]).tolist() for i in range(n)]


def bench_generate(checkpoint: str, prompts, max_tokens: int, expert_cache: int | None = None) -> dict:
    from dsv3_jax import load_pretrained
    from dsv3_jax.inference import Generation
    from dsv3_jax.inference.expert_cache import ExpertOffload

    model = load_pretrained(checkpoint)
    offload = ExpertOffload(model, expert_cache) if expert_cache else None

    def run(prompt):
        start, first = time.perf_counter(), None
        gen = Generation(model, np.array([prompt], np.int32), max_tokens, offload=offload)
        for _ in gen:
            first = first or time.perf_counter() - start
        return first, int(gen.stats.generated_tokens)

    for p in prompts:  # compile every (prompt length, cache bucket) before timing
        run(p)
    start = time.perf_counter()
    results = [run(p) for p in prompts]
    wall = time.perf_counter() - start
    return {"tokens": sum(n for _, n in results), "wall": wall, "ttft": [t for t, _ in results]}


class Server:
    def __init__(self, checkpoint: str, port: int, max_batch: int, max_seq_len: int, *flags: str):
        cmd = [sys.executable, "-m", "experiments.serve", f"--checkpoint={checkpoint}", f"--port={port}",
               f"--max_batch={max_batch}", f"--max_seq_len={max_seq_len}", "--chunk=32", "--max_queue=1024", *flags]
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.port, self.model = port, os.path.basename(os.path.normpath(checkpoint))
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                conn.getresponse().read()
                return
            except OSError:
                if self.proc.poll() is not None:
                    self.log.seek(0)
                    raise SystemExit("server failed:\n" + self.log.read()[-3000:])
                time.sleep(0.5)

    def stream(self, prompt: list[int], max_tokens: int, on_tokens=None, **extra) -> tuple[float, int]:
        """-> (time to first token, completion tokens) of one streamed completion; its text in self.texts.
        `on_tokens(n)` is called with each chunk's token count (the request needs logprobs=0)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start, first, tokens, text = time.perf_counter(), None, 0, ""
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            first = first or time.perf_counter() - start
            if on_tokens is not None:
                on_tokens(sum(len(c["logprobs"]["tokens"]) for c in chunk.get("choices", []) if c.get("logprobs")))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            text += "".join(c["text"] for c in chunk.get("choices", []))
        conn.close()
        self.last_text = text
        return first, tokens

    def metric_values(self) -> dict[str, float]:
        """The unlabelled dsv3_* values of /metrics."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("GET", "/metrics")
        values = {name: float(value) for name, value, *_ in (line.split() for line in
                  conn.getresponse().read().decode().splitlines()) if name.startswith("dsv3_") and "{" not in name}
        conn.close()
        return values

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def bench_server(server: Server, prompts, max_tokens: int, concurrency: int, **extra) -> dict:
    results, lock, todo = [], threading.Lock(), list(prompts)

    def client():
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop()
            r = server.stream(prompt, max_tokens, **extra)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    before = server.metric_values()
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    delta = {k: v - before.get(k, 0.0) for k, v in server.metric_values().items()}
    out = {"tokens": sum(n for _, n in results), "wall": wall, "ttft": [t for t, _ in results],
           "step_ms": 1e3 * delta["dsv3_decode_step_seconds_total"] / max(delta["dsv3_decode_steps_total"], 1)}
    if "dsv3_expert_cache_lookups_total" in delta:  # --expert_cache: the offloaded experts' cache over this run
        out["cache"] = (1 - delta["dsv3_expert_cache_misses_total"] / max(delta["dsv3_expert_cache_lookups_total"], 1),
                        delta["dsv3_expert_cache_bytes_moved_total"] / max(out["tokens"], 1),
                        delta["dsv3_expert_cache_stall_seconds_total"])
    return out


def bench_prefix(checkpoint: str, args) -> None:
    rng = np.random.default_rng(1)
    prefix = [1] + rng.integers(3, 2048, args.prefix - 1).tolist()
    prompts = [prefix + rng.integers(3, 2048, 16).tolist() for _ in range(args.requests)]
    paged = (f"--page_size={args.page_size}",) if args.page_size else ()
    server = Server(checkpoint, args.port, args.max_batch, args.prefix + 64, *paged)
    results = {}
    try:
        server.stream(prompts[0][:40], 2, prefix_cache=False)  # first request through the HTTP stack
        for name, on in (("off", False), ("on", True)):
            print(f"prefix cache {name} ...", flush=True)
            ttft, texts = [], []
            for prompt in prompts:
                ttft.append(server.stream(prompt, 8, prefix_cache=on)[0])
                texts.append(server.last_text)
            results[name] = (ttft, texts)
    finally:
        server.close()
    for name, (ttft, _) in results.items():
        print(f"prefix cache {name:3s}: {len(ttft)} requests, {args.prefix}-token shared prefix + 16: "
              f"TTFT p50 {np.median(ttft):.3f}s, mean {np.mean(ttft):.3f}s")
    ratio = np.median(results["off"][0]) / np.median(results["on"][0])
    same = results["off"][1] == results["on"][1]
    print(f"TTFT p50 off / on: {ratio:.2f}x (target >= 3x): {'PASS' if ratio >= 3 else 'FAIL'}; outputs identical: "
          f"{same}")


def bench_grammar(checkpoint: str, args) -> None:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": args.max_tokens}
    prompts = prompts_for(args.requests)
    server = Server(checkpoint, args.port, args.max_batch, 256)
    rows = []
    try:
        server.stream(prompts[0], 4, guided_json=schema)  # first request through the HTTP stack, schema compiled
        for c in sorted(int(c) for c in args.concurrency.split(",")):
            print(f"concurrency {c} ...", flush=True)
            runs = {"free": [], "json_schema": []}
            for _ in range(2):
                runs["free"].append(bench_server(server, prompts, args.max_tokens, c))
                runs["json_schema"].append(bench_server(server, prompts, args.max_tokens, c, guided_json=schema))
            rows.append((c, {k: (1e3 * sum(r["wall"] for r in v) / sum(r["tokens"] for r in v),
                                 np.mean([r["step_ms"] for r in v])) for k, v in runs.items()}))
    finally:
        server.close()
    print(f"\n{'conc':>4s} {'free ms/tok':>11s} {'json ms/tok':>11s} {'ratio':>6s} {'free step':>10s} "
          f"{'json step':>10s} {'ratio':>6s}")
    for c, r in rows:
        (free, free_step), (json_tok, json_step) = r["free"], r["json_schema"]
        print(f"{c:4d} {free:11.2f} {json_tok:11.2f} {json_tok / free:6.2f} {free_step:8.1f}ms {json_step:8.1f}ms "
              f"{json_step / free_step:6.2f}")


def mixed_trace(args) -> list[list[int]]:
    """--requests prompts: every --long_every-th near the context limit, the others of 16-40 tokens."""
    rng = np.random.default_rng(2)
    long = args.max_seq_len - args.max_tokens - 8
    lengths = [long if i % args.long_every == 0 else int(rng.integers(16, 41)) for i in range(args.requests)]
    return [[1] + rng.integers(3, 2048, n - 1).tolist() for n in lengths]


class Flight:
    """The client's books of a trace in flight: when each request was sent, the tokens it has
    streamed, whether it is done."""

    def __init__(self, prompts):
        self.prompts, self.lock = prompts, threading.Lock()
        self.sent, self.got, self.done = [None] * len(prompts), [0] * len(prompts), [False] * len(prompts)

    def send(self, server: Server, i: int, max_tokens: int) -> None:
        def on_tokens(n):
            with self.lock:
                self.got[i] += n

        self.sent[i] = time.perf_counter()
        server.stream(self.prompts[i], max_tokens, on_tokens=on_tokens, logprobs=0)
        with self.lock:
            self.done[i] = True

    def held(self, running: int) -> int:
        """Tokens the `running` requests hold as the client sees them (module docstring)."""
        with self.lock:
            live = [i for i, t in enumerate(self.sent) if t is not None and not self.done[i]]
            streaming = [i for i in live if self.got[i]]
            waiting = sorted((i for i in live if not self.got[i]), key=lambda i: self.sent[i])
            return (sum(len(self.prompts[i]) + self.got[i] for i in streaming)
                    + sum(len(self.prompts[i]) for i in waiting[:max(running - len(streaming), 0)]))


def run_trace(server: Server, prompts, max_tokens: int) -> dict:
    """Sends the trace 50 ms apart; -> samples (running, tokens used, preemptions, tokens held) every 0.1 s."""
    flight = Flight(prompts)
    threads = [threading.Thread(target=flight.send, args=(server, i, max_tokens)) for i in range(len(prompts))]

    def start_all():
        for t in threads:
            t.start()
            time.sleep(0.05)

    starter = threading.Thread(target=start_all)
    samples, start = [], time.perf_counter()
    starter.start()
    while starter.is_alive() or any(t.is_alive() for t in threads):
        m = server.metric_values()
        running = int(m["dsv3_requests_running"])
        samples.append((running, m.get("dsv3_cache_tokens_used"), m.get("dsv3_preemptions_total", 0.0),
                        flight.held(running)))
        time.sleep(0.1)
    for t in threads:
        t.join()
    return {"samples": samples, "wall": time.perf_counter() - start, "tokens": sum(flight.got)}


def bench_memory(checkpoint: str, args) -> None:
    from dsv3_jax import ModelConfig
    from dsv3_jax.checkpoint.orbax_layout import read_meta
    from dsv3_jax.inference import cache_bytes_per_token

    hf = os.path.join(checkpoint, "config.json")  # an HF folder, else a converted (Orbax) one
    cfg = (ModelConfig.from_hf_config(hf) if os.path.exists(hf)
           else ModelConfig.from_dict(read_meta(checkpoint)["model"]))
    token_bytes = cache_bytes_per_token(cfg, "float32") * cfg.num_layers
    budget, page_size = args.budget_slots * args.max_seq_len, args.page_size or 16
    prompts = mixed_trace(args)
    longs = sum(len(p) > 40 for p in prompts)
    print(f"trace: {len(prompts)} requests, {longs} of {len(prompts[0])} prompt tokens (every {args.long_every}th), "
          f"{len(prompts) - longs} of 16-40; {args.max_tokens} new tokens each; budget {budget} tokens "
          f"({budget * token_bytes / 1e6:.1f} MB of fp32 cache, {token_bytes} bytes a token)", flush=True)
    pool = (f"--page_size={page_size}", f"--max_cache_tokens={budget}")
    setups = (("a context per slot", args.budget_slots, pool), (f"shared, pages of {page_size}", args.max_batch, pool))
    results = {}
    for name, slots, extra in setups:
        print(f"{name}: starting experiments.serve with {slots} slots ...", flush=True)
        server = Server(checkpoint, args.port, slots, args.max_seq_len, "--cache_dtype=float32", *extra)
        try:
            server.stream(prompts[1], 2)  # first request through the HTTP stack
            results[name] = (slots, run_trace(server, prompts, args.max_tokens))
        finally:
            server.close()
    print(f"\n{'cache':<20} {'slots':>5} {'peak running':>12} {'mean running':>12} {'peak used tokens':>16} "
          f"{'peak held':>9} {'preemptions':>11} {'wall s':>7}")
    peaks = []
    for name, (slots, r) in results.items():
        running = [s[0] for s in r["samples"]]
        used = [s[1] for s in r["samples"]]
        peaks.append(max(running))
        print(f"{name:<20} {slots:5d} {max(running):12d} {np.mean([n for n in running if n]):12.1f} {max(used):16.0f} "
              f"{max(s[3] for s in r['samples']):9d} {r['samples'][-1][2]:11.0f} {r['wall']:7.1f}")
    ratio = peaks[1] / peaks[0]
    print(f"peak concurrent requests, shared / a context per slot: {ratio:.1f}x (target >= 4x): "
          f"{'PASS' if ratio >= 4 else 'FAIL'}")
    samples = results[setups[1][0]][1]["samples"]
    calm = [s for s in samples if s[2] == 0 and s[0] > 0]  # before any preemption, something running
    over = [(used - held) / running for running, used, _, held in calm]
    held, used = sum(s[3] for s in calm), sum(s[1] for s in calm)
    ok = calm and -1 <= min(over) and max(over) < page_size
    print(f"shared pool, {len(calm)} samples before any preemption: (used - held) / running request in "
          f"[{min(over):.2f}, {max(over):.2f}] tokens (target: within one page, [-1, {page_size})): "
          f"{'PASS' if ok else 'FAIL'}; used / held over them {used / held:.3f} "
          f"(pool: {budget} tokens, {budget * token_bytes / 1e6:.1f} MB)")


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("checkpoint", None, "checkpoint to serve (default: a small random model, converted)",
                        flag_values=fv)
    flags.DEFINE_integer("requests", 16, "requests at concurrency 1 and 4 (x2 at 16)", flag_values=fv)
    flags.DEFINE_integer("max_tokens", 64, "completion tokens per request", flag_values=fv)
    flags.DEFINE_integer("max_batch", 16, "the server's decode slots", flag_values=fv)
    flags.DEFINE_integer("port", 18765, "the server's port", flag_values=fv)
    flags.DEFINE_string("concurrency", "1,4,16", "client counts, comma-separated (1 must be one)", flag_values=fv)
    flags.DEFINE_enum("mode", "concurrency", ["concurrency", "prefix", "grammar", "memory"], "what to measure",
                      flag_values=fv)
    flags.DEFINE_integer("prefix", 1024, "--mode=prefix: shared prefix tokens", flag_values=fv)
    flags.DEFINE_integer("page_size", None, "tokens per page of the server's cache in --mode=prefix (default: the "
                         "server's) and --mode=memory (default 16)", flag_values=fv)
    flags.DEFINE_integer("long_every", 16, "--mode=memory: every n-th request near the context limit", flag_values=fv)
    flags.DEFINE_integer("max_seq_len", 1024, "--mode=memory: the context limit of one request", flag_values=fv)
    flags.DEFINE_integer("budget_slots", 4, "--mode=memory: the slots of the setup holding a context per slot; the "
                         "pool of both setups is this x --max_seq_len tokens", flag_values=fv)
    flags.DEFINE_integer("expert_cache", None, "concurrency mode: offload the routed experts behind a device cache "
                         "of C per layer (generate() and the server), and report its hit rate, bytes moved per "
                         "token and stall time", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    tmp = tempfile.TemporaryDirectory()
    checkpoint = args.checkpoint or make_model(tmp.name)
    if args.mode == "prefix":
        return bench_prefix(checkpoint, args)
    if args.mode == "grammar":
        return bench_grammar(checkpoint, args)
    if args.mode == "memory":
        return bench_memory(checkpoint, args)
    prompts = prompts_for(2 * args.requests)
    print("sequential generate() ...", flush=True)
    rows = [("generate() sequential", 1, bench_generate(checkpoint, prompts[:args.requests], args.max_tokens,
                                                        args.expert_cache))]
    print("starting experiments.serve (compiles before it listens) ...", flush=True)
    offload = ("--offload_experts", f"--expert_cache={args.expert_cache}") if args.expert_cache else ()
    server = Server(checkpoint, args.port, args.max_batch, 256, *offload)
    try:
        server.stream(prompts[0], 4)  # first request through the HTTP stack
        for c in sorted(int(c) for c in args.concurrency.split(",")):
            print(f"server at concurrency {c} ...", flush=True)
            rows.append(("server", c, bench_server(server, prompts[:args.requests * (2 if c == 16 else 1)],
                                                   args.max_tokens, c)))
    finally:
        server.close()
    base = rows[1][2]["tokens"] / rows[1][2]["wall"]
    print(f"\n{'mode':24s} {'conc':>4s} {'reqs':>4s} {'out tok/s':>10s} {'TTFT mean':>10s} {'TTFT p50':>9s} "
          f"{'x server c=1':>12s} {'decode step':>11s}")
    for name, c, r in rows:
        tps = r["tokens"] / r["wall"]
        step = f"{r['step_ms']:9.1f}ms" if "step_ms" in r else f"{'':>11s}"
        cache = "" if "cache" not in r else "  expert cache: hit rate {:.3f}, {:.0f} bytes/token, stall {:.2f}s".format(
            *r["cache"])
        print(f"{name:24s} {c:4d} {len(r['ttft']):4d} {tps:10.1f} {np.mean(r['ttft']):9.3f}s "
              f"{np.median(r['ttft']):8.3f}s {tps / base:12.2f} {step}{cache}")
    alone = rows[0][2]["tokens"] / rows[0][2]["wall"] / base
    print(f"\ngenerate() / server at concurrency 1, output tokens/s: {alone:.2f}x (target <= 1.3x): "
          f"{'PASS' if alone <= 1.3 else 'FAIL'}")
    c16 = [r for name, c, r in rows if c == 16]
    if c16:
        ratio = c16[0]["tokens"] / c16[0]["wall"] / base
        print(f"concurrency 16 / concurrency 1 output tokens/s: {ratio:.2f}x (target >= 4x): "
              f"{'PASS' if ratio >= 4 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m experiments.serve --mesh=tensor=2,expert=4` on 8 fake CPU devices (MLA heads on
`tensor`, experts on `expert`, run expert-parallel) answers 16 concurrent greedy requests of mixed
lengths on a paged cache split over the `expert` shards, too small for them all (requests are
preempted and resumed), with the tokens of the single-device server (the shared one, default pages),
with and without MTP speculation, and compiles nothing after its warm-up, with redundant experts
placed by EPLB for a skewed load (the answers of the default placement) and the decoded tokens'
expert load recorded at shutdown; with
`--weights=fp8` / `--weights=int4` (every projection quantized, each shard built where it lives) as
the single-device server holding the same quantized weights (those with the default placement); a
grammar-constrained and a free request sharing a batch answer as on one device.
`experiments.generate --mesh` likewise."""

import concurrent.futures
import re
import urllib.request

import numpy as np
import openai
import pytest

from sharding import eplb
from tests import helpers
from tests.serving.checkpoint import serve_config
from tests.serving.conftest import serve_process
from tests.serving.test_grammar import pair_answers

MESH = "--mesh=tensor=2,expert=4"
# 12 pages of 8 tokens per shard (one request of --max_seq_len) and 2 slots each (8 on 4 shards)
PAGED = ("--page_size=8", "--max_seq_len=96", "--max_cache_tokens=384", "--max_queue=16")
WEIGHTS = {"fp8": ["--weights=fp8"], "int4": ["--weights=int4", "--quantize=all", "--quant_group=16"]}


def _answers(url: str, model: str, prompts: list[list[int]], at_once: int | None = None) -> list[list[int]]:
    """Greedy token ids of the prompts, `at_once` (default all) in flight at a time."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def ask(i):
        out = client.completions.create(model=model, prompt=prompts[i], max_tokens=6 + i, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

    with concurrent.futures.ThreadPoolExecutor(at_once or len(prompts)) as pool:
        return list(pool.map(ask, range(len(prompts))))


def _prompts(lengths=(3, 9, 17, 30, 5, 12, 21, 8)) -> list[list[int]]:
    rng = np.random.RandomState(24)
    return [rng.randint(3, 2000, n).tolist() for n in lengths]


def _mixed_prompts() -> list[list[int]]:
    """Sixteen prompts of 29 to 48 tokens: on the paged server any two fit a shard's 12 pages (6 at
    most each) and outgrow them (7 at least each, with their 6 + i new tokens)."""
    return _prompts((44, 47, 41, 48, 39, 45, 37, 42, 35, 46, 33, 40, 31, 48, 29, 44))


def _mesh_servers_answer(checkpoint, tmp_path, want, *weights, modes=((), ("--use_mtp",)), want_pair=None,
                         prompts=_prompts):
    """The mesh server, in each of `modes` (default: with and without --use_mtp), gives `want` for
    `prompts()` (and `want_pair` for `pair_answers`, when given). -> each mode's /metrics text."""
    env = helpers.fake_device_env(8)
    metrics = []
    for flags in ([MESH, *weights, *mode] for mode in modes):
        log = tmp_path / "mesh.log"
        with serve_process(checkpoint, log, *flags, "--max_batch=8", env=env) as url:
            got = _answers(url, checkpoint.name, prompts())
            if want_pair is not None:
                assert pair_answers(url, checkpoint.name) == want_pair, flags
            metrics.append(urllib.request.urlopen(url + "/metrics", timeout=30).read().decode())
        text = log.read_text()
        assert got == want, (flags, text[-3000:])
        assert "on the mesh {'pipeline': 1, 'data': 1, 'fsdp': 1, 'expert': 4, 'tensor': 2}" in text, text[-3000:]
        assert "compiled after warm-up" not in text, (flags, text[-3000:])
    return metrics


def test_mesh_server_answers_as_one_device(server, served_checkpoint, tmp_path):
    """On a paged cache too small for the sixteen requests (some preempted in each mode), with E / 2
    redundant experts placed for a skewed load: its answers are the default placement's on the
    one-device server's (default pages, none preempted), with and without MTP; the load it records has a row per MoE
    layer, every layer the same routed tokens."""
    cfg = serve_config()
    layers, experts = cfg.num_moe_layers, cfg.num_routed_experts
    skewed = np.random.default_rng(0).zipf(1.2, (layers, experts)).astype(float)
    placement = eplb.rebalance(skewed, experts + experts // 2, cfg.num_expert_groups, 1, 4)
    eplb.save_placement(tmp_path / "placement.npz", placement)
    record = tmp_path / "load.json"
    flags = (f"--expert_placement={tmp_path / 'placement.npz'}", f"--record_expert_load={record}", *PAGED)
    want = _answers(server[0], server[1], _mixed_prompts(), at_once=8)  # within the shared server's queue
    metrics = _mesh_servers_answer(served_checkpoint, tmp_path, want, *flags, want_pair=pair_answers(*server),
                                   prompts=_mixed_prompts)
    for text in metrics:
        assert int(re.search(r"^dsv3_preemptions_total (\d+)", text, re.M).group(1)) > 0, text
    layer_ids, counts = eplb.read_load(record)
    assert layer_ids.tolist() == list(range(cfg.num_dense_layers, cfg.num_layers))
    assert counts.shape == (layers, experts) and len(set(counts.sum(-1))) == 1


@pytest.mark.parametrize("fmt", WEIGHTS)
def test_quantized_mesh_server_answers_as_one_device(served_checkpoint, tmp_path, fmt):
    """With MTP only: its prefill, draft and verify steps run the plain decode's forward too (the
    bf16 mesh server above is held in both modes)."""
    log = tmp_path / "one.log"
    with serve_process(served_checkpoint, log, *WEIGHTS[fmt]) as url:
        want = _answers(url, served_checkpoint.name, _prompts())
    assert f"projections held as {fmt} (all)" in log.read_text()
    _mesh_servers_answer(served_checkpoint, tmp_path, want, *WEIGHTS[fmt], modes=(("--use_mtp",),))


def _generate(checkpoint, *flags) -> list[str]:
    """experiments.generate's continuations of three prompts (a batch the 4 token shards of the mesh
    do not divide: padded), greedy."""
    res = helpers.run_module("experiments.generate", f"--checkpoint={checkpoint}", "--prompt=a fox", "--prompt=the",
                             "--prompt=over the lazy dog and", "--max_new_tokens=8", *flags,
                             env=helpers.fake_device_env(8), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return [line for line in res.stdout.splitlines() if not line.startswith(("prefill", "MTP"))]


def test_mesh_generate_answers_as_one_device(served_checkpoint):
    want = _generate(served_checkpoint)
    assert sum(line.startswith("--- ") for line in want) == 3, want
    assert _generate(served_checkpoint, MESH) == want  # MTP on the mesh: the servers above and below


def test_quantized_mesh_generate_answers_as_one_device(served_checkpoint):
    """int4 with --use_mtp (its prefill, draft and verify steps cover the plain decode's forward);
    fp8 on the mesh is the server test's above, through the same load and forward."""
    want = _generate(served_checkpoint, *WEIGHTS["int4"])
    assert _generate(served_checkpoint, MESH, "--use_mtp", *WEIGHTS["int4"]) == want

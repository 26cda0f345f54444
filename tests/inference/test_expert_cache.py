"""Routed experts offloaded behind a device cache: loaded straight into host memory
(`load_pretrained(offload_experts=True)`: the placement puts exactly the routed experts there, for
float and quantized weights), then the same tokens as the model with every expert resident (the
full-forward reference), through generate() and the serving engine, with MTP on and off, at cache
sizes top_k (= E/4 here) and E; the cache's counters and its errors."""

import jax
import numpy as np
import pytest
from flax import nnx

from dsv3_jax import load_pretrained
from dsv3_jax.checkpoint import load
from dsv3_jax.checkpoint.orbax_to_hf import write_hf
from dsv3_jax.data import load_tokenizer
from dsv3_jax.inference import generate
from dsv3_jax.inference.expert_cache import ExpertOffload
from dsv3_jax.model.params import logical_axes
from dsv3_jax.serving import Engine, Request, Runner, SamplingParams
from tests.helpers import TokenSink
from tests.inference.conftest import MAX_NEW, jax_compiles


@pytest.fixture(scope="module")
def hf_folder(model, tmp_path_factory):
    """The `model` fixture's weights (seed 0) as an HF folder, written by the converter's writer."""
    variables = {tuple(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}

    class Params:
        def read(self, path, index=()):
            return np.asarray(variables[path].get_value())[index]

    out = tmp_path_factory.mktemp("offload") / "hf"
    write_hf({"model": model.config.to_dict()}, Params(), out, progress=False)
    return str(out)


def offloaded(hf_folder, cache_size: int, **options):
    model = load_pretrained(hf_folder, offload_experts=True)
    return model, ExpertOffload(model, cache_size, **options)


def slot_counts(monkeypatch) -> list:
    """Records the slots per layer the device holds after each resize (growth, shrink, warm-up)."""
    sizes, resize = [], ExpertOffload._resize

    def recording(self, index_LxS):
        resize(self, index_LxS)
        sizes.append(self.expert_in.shape[1])
    monkeypatch.setattr(ExpertOffload, "_resize", recording)
    return sizes


def host_placed(monkeypatch) -> set:
    """Records the names of the arrays the loader's placement puts in `load.host_sharding`."""
    names, place_of = set(), load.placement_of_axes

    def recording(*args):
        place = place_of(*args)

        def where(axes, shape, name):
            sharding = place(axes, shape, name)
            if sharding is load.host_sharding():  # equal to the CPU device's own: told apart by identity
                names.add(name)
            return sharding
        return where

    monkeypatch.setattr(load, "placement_of_axes", recording)
    return names


def test_the_loader_builds_exactly_the_routed_experts_in_host_memory(model, hf_folder, monkeypatch):
    routed = set(load.ROUTED_EXPERTS)
    place, resident = load.placement_of_axes(None, None, True), load.placement_of_axes(None, None)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable):
            name = ".".join(map(str, path))
            for part in ("", ".q", ".scale"):  # a float leaf, or the QArray parts built under its name
                assert (place(logical_axes(var), var.shape, name + part) is load.host_sharding()) == (name in routed)
                assert resident(logical_axes(var), var.shape, name + part) is not load.host_sharding()
    names = host_placed(monkeypatch)
    for weights, parts in ((None, ("",)), ("int8", (".q", ".scale"))):
        names.clear()
        got = load_pretrained(hf_folder, weights=weights, offload_experts=True)
        assert names == {r + p for r in routed for p in parts}, weights
        want = load_pretrained(hf_folder, weights=weights)
        for a, b in zip(jax.tree.leaves(nnx.state(got)), jax.tree.leaves(nnx.state(want)), strict=True):
            np.testing.assert_array_equal(a, b)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))
    with pytest.raises(ValueError, match="offload_experts loads onto one device"):
        load_pretrained(hf_folder, mesh=mesh, offload_experts=True)


@pytest.mark.parametrize("cache_size,policy,use_mtp", [(4, "lru", False), (4, "lfu", True), (16, "lru", True)])
def test_offloaded_generation_equals_the_resident_model(hf_folder, ragged_batch, greedy_reference, cache_size, policy,
                                                        use_mtp, monkeypatch):
    """One row at a time, a one-token prefill chunk at C = top_k = E/4 (a step needs top_k experts per
    layer, 2 top_k with an MTP draft: the slots grow for it, to 2 C and no further, then shrink back to
    C) and at C = E."""
    prompts, lengths = ragged_batch
    model, offload = offloaded(hf_folder, cache_size, policy=policy)
    sizes = slot_counts(monkeypatch)
    for row in range(len(prompts)):
        out = generate(model, prompts[row:row + 1], MAX_NEW, lengths=lengths[row:row + 1], use_mtp=use_mtp,
                       offload=offload, prefill_chunk=1)
        np.testing.assert_array_equal(np.asarray(out)[0], greedy_reference[0][row])
    st, cfg = offload.stats, model.config
    assert st.steps * cfg.num_experts_per_token <= st.lookups <= st.steps * cfg.num_moe_layers * cfg.num_routed_experts
    assert st.bytes_moved == st.loaded * offload.expert_bytes
    if cache_size < 16:  # experts 0 .. C - 1 start resident: the others a step chooses are misses
        assert 0 < st.misses <= st.loaded
    else:  # every expert resident from the start: nothing to miss or load
        assert st.misses == st.loaded == 0 and st.lookups > 0
    assert offload.expert_in.shape[1] == cache_size  # back to C slots after the steps that needed more
    # a step's tokens are one row's: 1 prefill token or 1 + drafts decode tokens, top_k = 4 experts each
    assert max(sizes, default=cache_size) <= max(cache_size, min(16, 4 * (1 + use_mtp)))


def test_the_slots_never_grow_past_what_a_step_s_tokens_can_choose(hf_folder):
    """A runner whose steps run 2 tokens (a 2-token chunk of one row; one slot's decode) at C = top_k = 4:
    a step can choose at most 2 x 4 = 8 of the E = 16 experts a layer, so the warm-up compiles at 4 and
    8 slots, never 16, and is back at 4 after it, also when a compile fails."""
    model, offload = offloaded(hf_folder, 4)
    Runner(model, max_batch=1, max_seq_len=16, chunk=2, use_mtp=False, offload=offload)
    seen = []
    offload.warm_up(lambda: seen.append(offload.expert_in.shape[1]))
    assert seen == [4, 8] and offload.expert_in.shape[1] == 4

    def failing():
        if offload.expert_in.shape[1] > 4:
            raise RuntimeError("compile failed")
    with pytest.raises(RuntimeError, match="compile failed"):
        offload.warm_up(failing)
    assert offload.expert_in.shape[1] == 4


def test_served_requests_with_offloaded_experts_equal_the_resident_model(hf_folder, ragged_batch, greedy_reference):
    """C = E (every expert resident from the start: no miss), MTP off, the engine's per-row sampling and
    log-probabilities."""
    prompts, lengths = ragged_batch
    model, offload = offloaded(hf_folder, 16)
    runner = Runner(model, max_batch=2, max_seq_len=32, chunk=8, use_mtp=False, offload=offload)
    runner.warm_up()
    eng = Engine(runner, load_tokenizer(), max_queue=8)
    eng.start()
    try:
        sinks = [TokenSink() for _ in prompts]
        with jax_compiles() as compiles:
            for prompt, n, sink in zip(prompts, lengths, sinks):
                eng.submit(Request(prompt[:n].tolist(), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True), sink))
            for sink in sinks:
                assert sink.done.wait(300), "a request never finished"
    finally:
        eng.shutdown()
    assert compiles == [], "the warm-up compiles every step the cache runs"
    for reference, n, sink in zip(greedy_reference[0], lengths, sinks):
        assert sink.tokens == reference[n:n + MAX_NEW].tolist()
    text = eng.metrics.render(queue_length=0, slots_in_use=0)
    rate = float(next(line.split()[1] for line in text.splitlines() if line.startswith("dsv3_expert_cache_hit_rate")))
    assert rate == offload.stats.hit_rate == 1.0  # 1, not the 0 of no lookups: every lookup a hit
    assert offload.stats.misses == offload.stats.loaded == 0
    assert "dsv3_expert_cache_bytes_per_token" in text and "dsv3_expert_cache_stall_seconds_total" in text



@pytest.mark.parametrize("cache_size,policy,message", [(3, "lru", "expert_cache=3 must lie in"),
                                                        (17, "lru", "expert_cache=17 must lie in"),
                                                        (4, "fifo", "policy 'fifo'")])
def test_bad_cache_settings_are_named(model, cache_size, policy, message):
    with pytest.raises(ValueError, match=message):  # raised before the model is touched
        ExpertOffload(model, cache_size, policy=policy)


def test_eviction_takes_the_least_recently_or_least_often_used_expert(hf_folder):
    for policy, victim in (("lru", 2), ("lfu", 1)):
        _, offload = offloaded(hf_folder, 4, policy=policy)
        offload.expert_in[0] = [5, 6, 7, 8]  # slots 0..3
        offload.last_used[0, [5, 6, 7, 8]] = [9, 4, 3, 8]  # expert 7 (slot 2) the least recent
        offload.uses[0, [5, 6, 7, 8]] = [9, 1, 5, 8]  # expert 6 (slot 1) the least used
        keep = np.zeros(16, bool)
        assert offload._victim(0, keep) == victim
        keep[[5, 6, 7, 8]] = True
        assert offload._victim(0, keep) is None  # every resident expert is needed by the step


def test_the_offload_flags_are_checked_before_the_model_loads(tmp_path, capsys):
    """A bad flag is named (exit 2) though the checkpoint does not exist: nothing was loaded first."""
    from experiments import generate as generate_cli

    missing = f"--checkpoint={tmp_path / 'none'}"
    for flags, message in ((["--offload_experts"], "needs --expert_cache=C"),
                           (["--expert_cache=4"], "add --offload_experts"),
                           (["--offload_experts", "--expert_cache=4", "--mesh=expert=1"], "drop --mesh")):
        assert generate_cli.main([missing, "--prompt=hi", *flags]) == 2
        assert message in capsys.readouterr().err

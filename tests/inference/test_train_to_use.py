"""From a training run to use, as a new user would: train the tiny default a few steps, generate from
the run folder, export it with `--to-hf` and load the export in transformers with the same logits."""

import os
import subprocess
import sys

import numpy as np
import pytest

from dsv3_jax import load_pretrained
from dsv3_jax.checkpoint import run_folder
from dsv3_jax.checkpoint.orbax_to_hf import export_run
from tests.train.conftest import REPO, STEPS, train_env


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=train_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def run_dir(trained_run):
    return trained_run  # tests/conftest.py: trained once per session, shared with the fine-tuning tests


def test_run_folder_and_step_folder_resolve(run_dir):
    latest = run_folder.find(run_dir)
    assert latest.step == STEPS and latest.tokenizer is None  # the bundled tokenizer
    earlier = STEPS - 2  # the run keeps its last checkpoints (tests/train/conftest.py: every 2 steps)
    assert run_folder.find(run_dir / "checkpoints" / str(earlier)).step == earlier
    assert run_folder.find(run_dir / "checkpoints").step == STEPS
    with pytest.raises(Exception, match="steps"):
        run_folder.find(run_dir / "checkpoints" / "7")


def test_generate_from_the_run_folder(run_dir):
    res = _run("experiments.generate", f"--checkpoint={run_dir}", "--prompt=Once upon a time", "--max_new_tokens=4",
               "--prefill_chunk=4")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("Once upon a time") and "tokens/s" in res.stdout, res.stdout
    assert f"at step {STEPS}" in res.stderr
    bad = _run("experiments.generate", f"--checkpoint={run_dir}/nothing_here", "--prompt=x")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "is not a checkpoint" in bad.stderr, \
        bad.stderr[-2000:]


def test_export_to_hf_loads_in_transformers_with_the_same_logits(run_dir, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    out = tmp_path / "hf"
    res = _run("dsv3_jax.convert", "--to-hf", f"--ckpt={run_dir}", f"--out={out}", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "tokenizer.json").is_file()
    model = load_pretrained(run_dir, dtype="float32")
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 12))
    ours = np.asarray(model(tokens))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)).logits.numpy()
    assert np.std(ours) > 0.1
    assert np.max(np.abs(ours - theirs)) <= 1e-4 * np.max(np.abs(theirs))
    again = _run("dsv3_jax.convert", "--to-hf", f"--ckpt={run_dir}", f"--out={out}", "--no-progress")
    assert again.returncode == 2 and "already exists" in again.stderr


def test_export_reads_slices_and_equals_a_whole_model_export(run_dir, tmp_path, monkeypatch):
    """`--to-hf` of a run reads its train state one [layer] / [layer, expert] slice at a time
    (never a whole stacked leaf) and writes what the restored model, each leaf written whole into
    our layout and converted, gives: the export as it was done before it read per slice."""
    from dsv3_jax.checkpoint import hf_names, orbax_layout
    from dsv3_jax.checkpoint.load import _variables
    from dsv3_jax.checkpoint.orbax_to_hf import convert_orbax_to_hf
    from dsv3_jax.checkpoint.safetensors_io import HFCheckpoint

    model = load_pretrained(run_dir)  # Orbax restores every leaf whole
    variables = _variables(model)
    ref = str(tmp_path / "ref_ckpt")
    writer = orbax_layout.ItemWriter(os.path.join(ref, orbax_layout.PARAMS))
    for path, var in variables.items():
        value = np.asarray(var[...])
        writer.write(writer.create(path, value.shape, value.dtype, chunks=list(value.shape)), value)
    writer.finish()
    orbax_layout.write_config(ref, {"model": model.config.to_dict(), "fp8_leaves": []}, [orbax_layout.PARAMS])
    convert_orbax_to_hf(ref, tmp_path / "ref", progress=False)

    reads = []
    read = orbax_layout.ItemReader.read

    def counting_read(self, path, index=()):
        x = read(self, path, index)
        reads.append((path[1:], x.nbytes))  # path: ("params" | "router_bias", *parameter path)
        return x

    monkeypatch.setattr(orbax_layout.ItemReader, "read", counting_read)
    export_run(run_folder.find(run_dir), str(tmp_path / "hf"), progress=False)
    a, b = HFCheckpoint(str(tmp_path / "ref")), HFCheckpoint(str(tmp_path / "hf"))
    assert sorted(a.names()) == sorted(b.names()) and len(a.names()) > 20
    for name in a.names():
        x, y = a.read(name), b.read(name)
        assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), name
    slice_bytes = {}
    for leaf in hf_names.leaves(model.config):
        value = variables[leaf.path][...]
        k = hf_names.stacked_dims(leaf)
        slice_bytes[leaf.path] = value.nbytes // int(np.prod(value.shape[:k], dtype=np.int64))
    assert {p for p, _ in reads} == set(slice_bytes)
    assert all(n <= slice_bytes[p] for p, n in reads), [(p, n, slice_bytes[p]) for p, n in reads if n > slice_bytes[p]]
    # the stacks of several slices (experts; layers where there are several) are never read whole
    split = {p for p, n in slice_bytes.items() if n < variables[p][...].nbytes}
    experts = {leaf.path for leaf in hf_names.leaves(model.config) if hf_names.stacked_dims(leaf) == 2}
    assert experts and experts <= split, (experts, split)
    assert all(n < variables[p][...].nbytes for p, n in reads if p in split)


def test_export_tokenizer_and_transformers_generate_stops_at_eos(run_dir, tmp_path):
    """The export's tokenizer files and generation_config.json, as transformers reads them: the
    tokenizer knows bos/eos/pad and the chat template, and `generate` ends at the EOS."""
    torch = pytest.importorskip("torch")
    import transformers

    out = tmp_path / "hf"
    export_run(run_folder.find(run_dir), str(out), progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    assert prompt[0, 0] == 1 and tok.decode(prompt[0]).endswith("Assistant:")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert hf.generation_config.eos_token_id == 2 and hf.generation_config.pad_token_id == 0
    with torch.no_grad():
        free = hf.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:].tolist()
        assert 2 not in free  # the trained model does not end by itself here; make the 3rd token EOS
        third = free[2]
        hf.lm_head.weight[2] = hf.lm_head.weight[third] * 2.0  # EOS now outscores `third` wherever it wins
        stopped = hf.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert stopped[:-1] == free[:len(stopped) - 1] and stopped[-1] == 2 and len(stopped) <= 3, (free, stopped)


def test_transformers_generate_with_default_tokenization_gives_our_tokens(run_dir, tmp_path, capsys, monkeypatch):
    """transformers' greedy `generate` on the export, a text prompt tokenized as `AutoTokenizer`
    tokenizes by default, continues it as `experiments.generate` does (both prepend BOS). It drops
    only the MTP layer's weights, which docs/serving.md's `_keys_to_ignore_on_load_unexpected` silences."""
    torch = pytest.importorskip("torch")
    import transformers
    from dsv3_jax.data import load_tokenizer
    from experiments import generate

    out = tmp_path / "hf"
    export_run(run_folder.find(run_dir), str(out), progress=False)
    prompt, new = "The man said", 12
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    ours, _ = generate.encode_prompts(load_tokenizer(out), [prompt], bos=True)
    assert ids.tolist() == ours.tolist()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    mtp_layer = f"model.layers.{hf.config.num_hidden_layers}."
    assert info["unexpected_keys"] and all(k.startswith(mtp_layer) for k in info["unexpected_keys"])
    assert not info["missing_keys"]
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    continuation = tok.decode(theirs[0, ids.shape[1]:], skip_special_tokens=True)
    generate.main([f"--checkpoint={out}", f"--prompt={prompt}", f"--max_new_tokens={new}"])
    printed = capsys.readouterr().out
    assert printed.startswith(prompt + continuation + "\nprefill "), (printed, theirs.tolist())
    monkeypatch.setattr(type(hf), "_keys_to_ignore_on_load_unexpected", [mtp_layer.replace(".", r"\.")])
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["unexpected_keys"]

"""`python -m experiments.generate` on a tiny HF folder, with a character-level tokenizer that fits its vocab."""

import pathlib
import sys

import tokenizers

from tests.helpers import REPO, repo_env, run, run_module

ROOT = pathlib.Path(REPO)
HF_DIR = ROOT / "tests/fixtures/parity/lora_groups_yarn"  # vocab 128, 2 MoE layers


def char_tokenizer(path: pathlib.Path) -> pathlib.Path:
    chars = " abcdefghijklmnopqrstuvwxyz.,"
    vocab = {"<|pad|>": 0, "<|bos|>": 1, "<|eos|>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<|pad|>"))
    tok.add_special_tokens(["<|pad|>", "<|bos|>", "<|eos|>"])
    tok.save(str(path))
    return path


def test_cli_streams_and_reports(tmp_path):
    tok = char_tokenizer(tmp_path / "tokenizer.json")
    res = run_module("experiments.generate", f"--checkpoint={HF_DIR}", f"--tokenizer={tok}", "--prompt=hello world",
                     "--max_new_tokens=5", "--stats", "--cache_dtype=int8", "--page_size=4", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert out.startswith("hello world"), out
    assert "tokens/s" in out
    layers = [line for line in out.splitlines() if line.strip().startswith("layer")]
    assert len(layers) == 2, out  # one line of expert frequencies per MoE layer
    freqs = [float(x) for x in layers[0].split(":")[1].split("|")[0].split()]
    assert len(freqs) == 16 and abs(sum(freqs) - 4) < 1e-3  # each prompt token picks 4 experts


def test_cli_error_names_out_of_range_prompt_ids(tmp_path):
    res = run_module("experiments.generate", f"--checkpoint={HF_DIR}",
                     "--prompt=Some text for the bundled 2048-token vocabulary", "--max_new_tokens=2", timeout=600)
    assert res.returncode != 0 and "vocab_size=128" in res.stderr, res.stderr[-2000:]


def test_generate_needs_no_serving_extra():
    # `pip install -e .` has no fastapi (the serve extra does); generate must not import the server.
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, *a):\n"
            "        if name.split('.')[0] in ('fastapi', 'uvicorn'): raise ImportError('blocked ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import experiments.generate\n")
    result = run([sys.executable, "-c", code], repo_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]

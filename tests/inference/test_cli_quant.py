"""`python -m experiments.generate --weights=...`: quantized weights through the CLI (one forward,
the load of load_pretrained(weights=...)); a bad flag exits 2 naming it."""

from tests.helpers import run_module
from tests.inference.test_cli import HF_DIR, char_tokenizer


def test_cli_generates_with_int4_weights(tmp_path):
    tok = char_tokenizer(tmp_path / "tokenizer.json")
    res = run_module("experiments.generate", f"--checkpoint={HF_DIR}", f"--tokenizer={tok}", "--prompt=hello world",
                     "--max_new_tokens=4", "--weights=int4", "--quantize=all", "--quant_group=16", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("hello world") and "tokens/s" in res.stdout, res.stdout


def test_cli_bad_group_exits_2_naming_it(tmp_path):
    res = run_module("experiments.generate", f"--checkpoint={HF_DIR}", "--prompt=hi", "--weights=int8",
                     "--quant_group=0", timeout=600)
    assert res.returncode == 2 and "quant_group=0" in res.stderr, res.stderr[-2000:]

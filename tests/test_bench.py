"""`python -m experiments.bench` end to end through its command line: the sweep over config
variants on a tiny grid (worker processes of both frameworks, the summary, the ratio table), the
JSON and the report written between the markers of an existing file, and a bad flag."""

import json

from tests.helpers import run_module


def test_sweep_writes_the_json_and_the_ratio_table_between_the_markers(tmp_path):
    report = tmp_path / "benchmarks.md"
    report.write_text("# Benchmarks\n\nkept above\n\n<!-- bench:begin -->\nold table\n<!-- bench:end -->\n\nkept below\n")
    result = run_module("experiments.bench", "--only=sweep", "--variants=tiny", "--quick", "--repeats=1",
                        f"--json={tmp_path / 'bench.json'}", f"--out={report}", timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["summary"]["rows"]
    for measure in ("train", "prefill 64 b2", "decode 64 b2"):
        row = rows[f"tiny: {measure} | jax"]
        assert row["tokens_per_s"] > 0 and row["peak_rss_gb"] > 0.1, (measure, row)
    assert rows["tiny: prefill 64 b2 | jax"]["compile_s"] > 0
    text = report.read_text()
    assert "kept above" in text and "kept below" in text and "old table" not in text
    assert "Command: `python -m experiments.bench --only=sweep --variants=tiny" in text
    hf = rows.get("tiny: train | hf")
    if hf is not None:  # transformers installed: the ratio table, its figures from the rows
        ratios = [rows[f"tiny: {m} | jax"]["tokens_per_s"] / rows[f"tiny: {m} | hf"]["tokens_per_s"]
                  for m in ("train", "prefill 64 b2", "decode 64 b2")]
        assert "| variant | train | prefill 64 b2 | decode 64 b2 |" in text
        assert "| tiny | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |" in text
        assert "| **minimum** | " + " | ".join(f"**{r:.2f}x**" for r in ratios) + " |" in text


def test_unknown_variant_exits_2_naming_the_flag():
    result = run_module("experiments.bench", "--only=sweep", "--variants=nope", timeout=120)
    assert result.returncode == 2 and "--variants" in result.stderr.splitlines()[-1], result.stderr

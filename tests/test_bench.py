"""`python -m experiments.bench` end to end through its command line: a worker process, the
summary, the JSON and the report written between the markers of an existing file."""

import json

from tests.helpers import run_module


def test_bench_writes_the_json_and_the_report_between_the_markers(tmp_path):
    report = tmp_path / "benchmarks.md"
    report.write_text("# Benchmarks\n\nkept above\n\n<!-- bench:begin -->\nold table\n<!-- bench:end -->\n\nkept below\n")
    result = run_module("experiments.bench", "--only=decode", "--decode=64x1", "--new_tokens=4", "--repeats=1",
                        "--no_hf", f"--json={tmp_path / 'bench.json'}", f"--out={report}", timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    row = json.loads((tmp_path / "bench.json").read_text())["summary"]["rows"]["decode 64 b1 | jax"]
    assert row["tokens_per_s"] > 0 and row["compile_s"] > 0 and row["peak_rss_gb"] > 0.1
    text = report.read_text()
    assert "kept above" in text and "kept below" in text and "old table" not in text
    assert "| decode 64 b1 | jax |" in text and "Command: `python -m experiments.bench --only=decode" in text

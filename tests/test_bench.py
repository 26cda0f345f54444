"""`python -m benchmarks.bench` end to end through its command line: the sweep over config
variants on a tiny grid (worker processes of both frameworks, the summary, the ratio table, the
prefill through a paged cache), the JSON and the report written between the markers of an existing
file, and a bad flag; the parts `benchmarks.profile_step` groups a step's ops into."""

import json

import pytest

from tests.helpers import run_module


def test_sweep_writes_the_json_and_the_ratio_table_between_the_markers(tmp_path):
    report = tmp_path / "benchmarks.md"
    report.write_text("# Benchmarks\n\nkept above\n\n<!-- bench:begin -->\nold table\n<!-- bench:end -->\n\nkept below\n")
    result = run_module("benchmarks.bench", "--only=sweep", "--variants=tiny", "--quick", "--repeats=1",
                        "--page_size=16", f"--json={tmp_path / 'bench.json'}", f"--out={report}", timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["summary"]["rows"]
    for measure in ("train", "prefill 64 b2 paged 16", "decode 64 b2"):
        row = rows[f"tiny: {measure} | jax"]
        assert row["tokens_per_s"] > 0 and row["peak_rss_gb"] > 0.1, (measure, row)
    assert rows["tiny: prefill 64 b2 paged 16 | jax"]["compile_s"] > 0
    text = report.read_text()
    assert "kept above" in text and "kept below" in text and "old table" not in text
    assert "Command: `python -m benchmarks.bench --only=sweep --variants=tiny" in text
    hf = rows.get("tiny: train | hf")
    if hf is not None:  # transformers installed: the ratio table, its figures from the rows
        ratios = [rows[f"tiny: {m} | jax"]["tokens_per_s"] / rows[f"tiny: {m} | hf"]["tokens_per_s"]
                  for m in ("train", "prefill 64 b2 paged 16", "decode 64 b2")]
        assert "| variant | train | prefill 64 b2 paged 16 | decode 64 b2 |" in text
        assert "| tiny | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |" in text
        assert "| **minimum** | " + " | ".join(f"**{r:.2f}x**" for r in ratios) + " |" in text


def test_unknown_variant_exits_2_naming_the_flag():
    result = run_module("benchmarks.bench", "--only=sweep", "--variants=nope", timeout=120)
    assert result.returncode == 2 and "--variants" in result.stderr.splitlines()[-1], result.stderr


def test_profile_groups_name_each_part_of_the_step():
    from benchmarks.profile_step import OTHER, group_shares

    # Labels as benchmarks.profile_step writes them for the issue27 train step, each with the
    # part it belongs to by reading the model: batched expert matmuls and the transposes of their
    # backward, the chunked head, attention, a 2-D projection, AdamW's guard, the stack's gradient
    # concatenation, an activation.
    labelled = {
        "fwd cond/branch_0_fun/ECD,EDF->ECF/dot_general": (40.0, "routed experts"),
        "bwd cond/branch_0_fun/ECF,EFD->ECD/transpose": (10.0, "routed experts"),
        "fwd cond/branch_0_fun/BCD,DV->BCV/dot_general": (20.0, "head + cross-entropy"),
        "bwd BHTS,BHTV->BHSV/dot_general": (5.0, "attention"),
        "fwd cond/branch_0_fun/dot_general": (10.0, "other matmuls (MLA projections, dense and shared MLPs)"),
        "fwd jit(_where/select_n": (6.0, "optimizer + state update"),
        "bwd concatenate": (4.0, "layer stack slices + gradient concatenation"),
        "fwd cond/branch_0_fun/jit(silu/mul": (5.0, OTHER),
    }
    shares = dict(group_shares({label: us for label, (us, _) in labelled.items()}))
    expected = {}
    for us, part in labelled.values():
        expected[part] = expected.get(part, 0.0) + us / 100.0
    assert shares == pytest.approx(expected)
    assert list(dict(group_shares({"a": 1.0, "fwd slice": 3.0}))) == ["layer stack slices + gradient concatenation", OTHER]

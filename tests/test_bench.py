"""`python -m benchmarks.bench` end to end through its command line: the sweep over config
variants on a tiny grid (worker processes of both frameworks, the summary, the ratio table, the
prefill through a paged cache), the JSON and the report written between the markers of an existing
file, and a bad flag; the parts `benchmarks.profile_step` groups a step's ops into; `benchmarks.device_report`'s
CPU smoke run in this process (its rows, the defaults it names, the markdown) and its budget."""

import ast
import dataclasses
import json
import math
import pathlib

import pytest

from tests.helpers import run_module

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# benchmarks.device_report's rows the smoke test runs: all but train_fp8, which is train_bf16's code
# with fp8_matmul=True (the FP8 train step has its own tests) and would add a third to the test's time.
SMOKE_ROWS = ("fp8_gemm", "fp8_grouped", "mla_decode_bf16", "mla_decode_fp8", "mla_prefill", "mla_prefill_bwd",
              "train_bf16", "int8_grouped", "int4_grouped", "inference")


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

    # Labels as benchmarks.profile_step writes them for the e32_top4 train step, each with the
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


def _defined(path: str, name: str) -> bool:
    """Whether `path` (repository-relative) defines `name` (a function, class or assigned name) or
    `Class.method` at its top level."""
    tree = ast.parse((REPO_ROOT / path).read_text())
    top, _, method = name.partition(".")
    for node in tree.body:
        if isinstance(node, ast.Assign) and not method and any(getattr(t, "id", None) == top for t in node.targets):
            return True
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == top:
            return not method or any(getattr(item, "name", None) == method for item in node.body)
    return False


def test_device_report_smoke_writes_every_row_and_defaults_that_name_config_fields(tmp_path):
    from benchmarks import device_report
    from benchmarks.device_report_kernels import SMOKE_SHAPES as sh
    from dsv3_jax import ModelConfig

    assert device_report.main(["--smoke", "--out", str(tmp_path), f"--only={','.join(SMOKE_ROWS)}"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    rows = report["rows"]
    assert list(rows) == list(SMOKE_ROWS)
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row)  # the smoke shapes run on CPU
        if row["kind"] == "kernel":
            for side in ("pallas", "xla"):
                assert math.isfinite(row[side]["s"]) and row[side]["s"] > 0, (name, side, row[side])
            # each kernel against an independent XLA form; fp8_grouped's is bf16, the rest share numerics
            assert row["rel_err"] < (0.1 if name == "fp8_grouped" else 1e-2), (name, row["rel_err"])
    # bytes of one decode step: the cache as FlashMLA lays it out, read once
    b, s, _ = sh.decode_BxSxH
    c, r = sh.latent_CxR
    assert rows["mla_decode_bf16"]["pallas"]["bytes"] == b * s * (2 * c + 2 * r)
    assert rows["mla_decode_fp8"]["xla"]["bytes"] == b * s * (c + 4 * (c // 128) + 2 * r)
    m, k, n = sh.gemm_MxKxN
    assert rows["fp8_gemm"]["flops"] == 2 * m * k * n
    train = rows["train_bf16"]
    assert train["tokens_per_s"] > 0 and train["config"]["params"] == ModelConfig.tiny(
        num_layers=2, num_mtp_layers=0).param_counts()["total"]

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for op, d in report["defaults"].items():
        assert d["config_field"] is None or d["config_field"] in fields, (op, d)
        path, name = d["choice_point"].split(":")
        assert _defined(path, name), (op, d["choice_point"])
    measured = {d["row"] for d in report["defaults"].values() if d["faster"]}
    assert measured == set(SMOKE_ROWS) & {d["row"] for d in report["defaults"].values()}
    assert report["defaults"]["train_recipe"]["faster"] is None  # train_fp8 did not run

    text = (tmp_path / "report.md").read_text()
    table_rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    assert set(SMOKE_ROWS) <= set(table_rows), text


def test_device_report_skips_the_rows_past_its_budget_and_rejects_bad_flags(tmp_path, capsys):
    from benchmarks import device_report

    assert device_report.main(["--smoke", f"--out={tmp_path}", "--only=fp8_gemm,train_fp8", "--budget_s=1e-9"]) == 0
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert [row["status"] for row in rows.values()] == ["skipped", "skipped"], rows
    assert "| train_fp8 | skipped: budget of" in (tmp_path / "report.md").read_text()
    with pytest.raises(SystemExit) as exit_:
        device_report.main(["--smoke", f"--out={tmp_path}", "--only=fp8_gemm,nope"])
    assert exit_.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # the 671B's shapes on this CPU-only host
        device_report.main([f"--out={tmp_path}", "--only=fp8_gemm"])
    assert exit_.value.code == 2 and "--smoke" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert device_report.main(["--smoke", f"--out={tmp_path / 'a_file' / 'report'}", "--only=fp8_gemm"]) == 2
    assert "a_file" in capsys.readouterr().err.strip().splitlines()[-1]


def test_device_report_records_a_failing_kernel_and_a_failing_row_and_goes_on(tmp_path, monkeypatch):
    from benchmarks import device_report
    from benchmarks.device_report_kernels import fp8_gemm

    def kernel_fails(sh):
        def fail(*args):
            raise ValueError("does not lower here\nthe rest of the message")

        case = fp8_gemm(sh)
        return case._replace(pallas=case.pallas._replace(fn=fail))

    def row_fails(ctx):
        raise MemoryError("out of memory")

    monkeypatch.setitem(device_report.ROWS, "fp8_gemm", device_report.kernel_row("FP8 GEMM", kernel_fails))
    monkeypatch.setitem(device_report.ROWS, "inference", device_report.Row("generate", "inference", row_fails))
    assert device_report.main(["--smoke", f"--out={tmp_path}", "--only=inference,fp8_gemm"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    gemm, inference = report["rows"]["fp8_gemm"], report["rows"]["inference"]
    assert inference["status"] == "error" and inference["error"] == "MemoryError: out of memory"
    assert gemm["status"] == "ok" and gemm["pallas"] == {"error": "ValueError: does not lower here"}
    assert gemm["xla"]["s"] > 0 and gemm["faster"] == "xla" and gemm["rel_err"] is None
    assert report["defaults"]["fp8_gemm"]["pallas_error"] == "ValueError: does not lower here"
    text = (tmp_path / "report.md").read_text()
    assert "| inference | error: MemoryError: out of memory |" in text
    assert "failed: ValueError: does not lower here" in text

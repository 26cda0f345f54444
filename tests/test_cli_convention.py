"""Every command (experiments/, benchmarks/, research/ and the library's own: dsv3_jax.convert,
dsv3_jax.data.make_tokenizer ...) follows CONTRIBUTING.md's convention: absl flags parsed per call
by `dsv3_jax.cli.parse`, `--help` exits 0, a bad flag exits 2 with one line, and no module imports
argparse."""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("experiments", "benchmarks", "research", "dsv3_jax")


def _modules() -> list[str]:
    files = [f for folder in FOLDERS for f in sorted((ROOT / folder).rglob("*.py"))]
    return [".".join(f.relative_to(ROOT).with_suffix("").parts) for f in files if f.name != "__init__.py"]


def _commands() -> list[str]:
    """The modules that run as `python -m` (an `if __name__ == "__main__":` block)."""
    return [m for m in _modules() if '__name__ == "__main__"' in (ROOT / (m.replace(".", "/") + ".py")).read_text()]


@pytest.mark.parametrize("module", _modules())
def test_no_argparse(module):
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "argparse" not in imported, module


@pytest.mark.parametrize("module", _commands())
def test_help_exits_0_and_a_bad_flag_exits_2(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "--" in capsys.readouterr().out  # the flags are listed
    with pytest.raises(SystemExit) as exit_:
        main(["--no_such_flag=1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_flag" in err[0], err


def test_commands_sharing_flag_names_run_in_one_process():
    """convert and generate both define --out/--dtype-style names; train and plan both --config: each
    call parses into its own flags, so a second call does not see the first one's values."""
    from dsv3_jax import cli
    from experiments import plan, train

    first = cli.parse(train.define_flags, ["--steps=3", "--config.data.batch_size=3"], "")
    second = cli.parse(plan.define_flags, ["--config.data.batch_size=5"], "")
    third = cli.parse(train.define_flags, [], "")
    assert (first.steps, first.config.data.batch_size) == (3, 3)
    assert second.config.data.batch_size == 5
    assert third.steps is None and third.config.data.batch_size not in (3, 5)

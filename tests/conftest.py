"""Test-session settings: a compilation cache shared by pytest workers and the subprocesses they start."""

import os
import tempfile

import jax
import pytest

# XLA:CPU compiles dominate the suite's time; every process of one session reuses them.
_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dsv3_jax_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true",
                     help="Run the tests in reverse collection order (a check that no test depends on another "
                          "having run first).")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A training run folder (the test-sized tiny model, tests/train/conftest.py STEPS steps,
    checkpoints every 20), trained once per session for the tests that start from a run."""
    from tests.train.conftest import run_train

    workdir = tmp_path_factory.mktemp("run")
    result = run_train(workdir, "--config.train.checkpoint_every=20", cache_dir=_CACHE)
    assert "experiments.generate --checkpoint=" in result.stdout and "--to-hf" in result.stdout, result.stdout
    return workdir

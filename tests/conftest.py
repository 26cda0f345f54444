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


# Modules whose tests take minutes (subprocesses on 8 fake devices, servers, train CLI runs),
# heaviest first. pytest.ini hands the workers whole modules (`--dist loadscope`: a module's
# fixtures and compiled functions are built in one worker, not in both) in collection order; these
# go first, so neither worker ends the session alone with one of them.
SLOW_FIRST = (
    "tests/sharding/test_parity.py", "tests/serving/test_mesh_serve.py", "tests/train/test_lora_cli.py",
    "tests/sharding/test_plan.py", "tests/sharding/test_multihost_train.py", "tests/sharding/test_train_cli.py",
    "tests/train/test_train_cli.py", "tests/sharding/test_multihost.py", "tests/train/test_fp8_resume.py",
    "tests/test_bench.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {module: i for i, module in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected
    if config.getoption("--reverse"):
        items.reverse()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A training run folder (the test-sized tiny model, tests/train/conftest.py STEPS steps): the
    session's one pretraining run, shared with the training and fine-tuning tests."""
    from tests.train.conftest import pretraining_run

    workdir, _, _, stdout = pretraining_run(tmp_path_factory)
    assert "experiments.generate --checkpoint=" in stdout and "--to-hf" in stdout, stdout
    return workdir

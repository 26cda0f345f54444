"""Test-session settings: a compilation cache shared by the subprocesses the pytest workers start."""

import os
import tempfile

import jax
import pytest

# XLA:CPU compiles dominate the suite's time: the subprocesses (CLI runs, servers, fake-device
# meshes) share theirs through a persistent cache. The pytest workers keep theirs in memory only:
# in three of five full runs a long-lived worker died in XLA:CPU's executable (de)serialization
# for that cache (a segfault reading an entry another process wrote, twice; an abort writing one).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dsv3_jax_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
jax.config.update("jax_enable_compilation_cache", False)


def _compile_cheaply_in_this_process():
    """XLA:CPU's cheap code generation (tests.helpers.FAST_COMPILE) for the programs the pytest
    process compiles: compiling, not running, dominates its tests (half the CPU time at these flags).
    XLA reads XLA_FLAGS once, at its first compile, so the environment is restored after one:
    subprocesses (CLI runs that hit the persistent cache, servers) keep the default code generation,
    and fake-device ones set their own flags."""
    from tests.helpers import FAST_COMPILE

    before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{before or ''} {FAST_COMPILE}".strip()
    try:
        jax.jit(lambda x: x + 1)(1).block_until_ready()
    finally:
        if before is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = before


_compile_cheaply_in_this_process()


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

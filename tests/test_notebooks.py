"""The notebooks under notebooks/ (jupytext percent-format sources) run end to end on CPU.

Each is turned into an .ipynb here and executed with nbclient in a fresh IPython kernel whose
working directory is the repository root; a cell that raises fails the test with its traceback.
"""

import os
import re

import jupytext
import nbclient
import nbformat
import pytest

from tests import helpers

NOTEBOOKS = os.path.join(helpers.REPO, "notebooks")
# name -> the kernel's environment. checkpoints_and_sharding asks for 8 fake CPU devices itself
# (XLA_FLAGS before jax is imported), so its kernel gets the fake-device environment: no
# XLA_FLAGS of ours, no persistent compilation cache (see helpers.fake_device_env).
KERNEL_ENV = {
    "quickstart": helpers.repo_env,
    "checkpoints_and_sharding": lambda: helpers.fake_device_env(8),
    "experts": helpers.repo_env,
}


def _sources() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(NOTEBOOKS) if f.endswith(".py"))


def test_every_notebook_is_executed_here():
    assert _sources() == sorted(KERNEL_ENV)


@pytest.mark.parametrize("name", sorted(KERNEL_ENV))
def test_notebook_runs(name, tmp_path):
    nb = jupytext.read(os.path.join(NOTEBOOKS, f"{name}.py"))
    first_markdown = next(c.source for c in nb.cells if c.cell_type == "markdown")
    assert re.search(r"Run time: about \d+ s on a 2-core CPU", first_markdown), "state the measured run time"
    env = dict(KERNEL_ENV[name](), MPLBACKEND="Agg")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": helpers.REPO}})
    client.execute(env=env)
    nbformat.write(nb, str(tmp_path / f"{name}.ipynb"))  # the executed notebook, for a failing run's reader
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors

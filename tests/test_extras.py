"""A plain `pip install -e .` (no extras) runs the README's first command, and the features that need
an extra say which one: one process in which every module of the extras' optional packages fails
to import, as in a fresh virtualenv (.ci/run also installs into one for real)."""

import subprocess
import sys

from tests.helpers import REPO, repo_env

# Top-level modules of the packages only the extras bring (setup.py extras_require), and theirs.
OPTIONAL = ("fastapi", "starlette", "pydantic", "uvicorn", "psutil", "gcsfs", "google.cloud", "torch",
            "transformers", "peft", "openai", "lm_eval", "jupytext", "nbclient", "gcp_storage_emulator",
            "llguidance", "jsonschema")

SCRIPT = f"""
import sys

class Absent:  # every optional module is missing, as in an environment without the extras
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in {OPTIONAL!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Absent())
import experiments.generate, experiments.train, dsv3_jax.convert, dsv3_jax.data  # the README's first command
try:
    import dsv3_jax.serving
except ModuleNotFoundError as e:
    print("serving:", e)
from dsv3_jax import paths
try:
    paths.at("gs://bucket/run")
except ModuleNotFoundError as e:
    print("gs:", e)
print("local:", paths.at("runs/tiny").name)
from experiments import serve
print("serve exit:", serve.main(["--checkpoint=runs/tiny"]))
"""


def test_core_imports_without_extras_and_features_name_their_extra():
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=repo_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[:4] == [
        "serving: dsv3_jax.serving needs fastapi, from the 'serve' extra: pip install -e \".[serve]\"",
        "gs: gs://bucket/run needs gcsfs, from the 'gcs' extra: pip install -e \".[gcs]\"",
        "local: tiny",
        "serve exit: 2"], res.stdout
    assert res.stderr.strip().splitlines()[-1] == (
        "error: dsv3_jax.serving needs fastapi, from the 'serve' extra: pip install -e \".[serve]\""), res.stderr

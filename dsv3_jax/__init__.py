"""dsv3-jax: DeepSeek-V3 (MLA, DeepSeekMoE, MTP) in JAX/Flax NNX.

Public names load lazily so that light subpackages (`dsv3_jax.data` in grain worker processes)
do not import jax, flax and orbax.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "dsv3_jax.config", "YarnConfig": "dsv3_jax.config", "ConfigError": "dsv3_jax.config",
    "DeepSeekV3": "dsv3_jax.model", "ModelOutput": "dsv3_jax.model",
    "load_pretrained": "dsv3_jax.checkpoint", "CheckpointError": "dsv3_jax.checkpoint",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dsv3_jax' has no attribute {name!r}")


def require_extra(extra: str, *modules: str, needed_by: str) -> None:
    """Imports `modules`, those of setup.py's `extra` that `needed_by` uses; a missing one raises
    ModuleNotFoundError saying which pip command installs it (a plain `pip install -e .` has no extras)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"{needed_by} needs {e.name}, from the {extra!r} extra: "
                                      f"pip install -e \".[{extra}]\"", name=e.name) from e


def __dir__():
    return __all__ + ["__version__"]

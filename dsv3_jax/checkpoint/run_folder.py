"""A training run's folder, or one of its step folders, as a checkpoint to use: the step's weights,
the run's model config and the run's tokenizer.

Layout written by `python -m experiments.train --workdir=RUN`:
  RUN/model_config.json        the architecture (ModelConfig.to_dict)
  RUN/config.json              the run's config (data.tokenizer: None = the bundled tokenizer)
  RUN/checkpoints/<step>/state the TrainState (params, router_bias, optimizer state, ...)
`RUN` resolves to its latest complete step; `RUN/checkpoints/<step>` to that step. `StateParams`
is where every consumer finds a step's weights: `load.load_run` restores them through it (Orbax,
each straight into its target sharding, or quantized per shard from its slices), the HF export
reads its slices. RUN may be a URL
(`gs://bucket/run`, dsv3_jax/paths.py), as the trainer writes it.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

from dsv3_jax import paths
from dsv3_jax.checkpoint import integrity, orbax_layout
from dsv3_jax.checkpoint.safetensors_io import CheckpointError
from dsv3_jax.config import ModelConfig


class RunStep(NamedTuple):
    run_dir: str
    step: int
    step_dir: str  # RUN/checkpoints/<step>
    tokenizer: str | None  # tokenizer.json of the run (None: the bundled one)

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(json.loads(paths.at(paths.join(self.run_dir, "model_config.json")).read_text()))

    def config(self) -> dict:
        """The run's config.json: its `data`, `train` and (a LoRA run) `lora` sections."""
        return _config(self.run_dir)


def _is_run(path: str) -> bool:
    return (paths.at(paths.join(path, "model_config.json")).is_file()
            and paths.at(paths.join(path, "checkpoints")).is_dir())


def _complete_steps(checkpoints: str) -> list[int]:
    """Steps whose folder Orbax finished: locally, unfinished saves live in temporary folders; on
    an object store (no atomic rename) Orbax writes commit_success.txt last."""
    marker = "commit_success.txt" if paths.is_url(checkpoints) else "_CHECKPOINT_METADATA"
    return sorted(int(d.name) for d in paths.at(checkpoints).iterdir() if d.name.isdigit() and (d / marker).exists())


def _config(run_dir: str) -> dict:
    """The run's config.json ({} when absent or unreadable)."""
    try:
        return json.loads(paths.at(paths.join(run_dir, "config.json")).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def find(path: str | os.PathLike) -> RunStep | None:
    """The step `path` names (a run folder: its latest), or None when it is no training run's folder."""
    path = paths.resolve(path)
    parent = paths.parent(path)
    if _is_run(path):
        run_dir, step = path, None
    elif paths.name(path) == "checkpoints" and _is_run(parent):
        run_dir, step = parent, None
    elif paths.name(parent) == "checkpoints" and _is_run(paths.parent(parent)):
        run_dir, step = paths.parent(parent), paths.name(path)
        if not step.isdigit():
            raise CheckpointError(f"{path} is not a step folder of the run {run_dir} (expected checkpoints/<step>)")
        step = int(step)
    else:
        return None
    steps = _complete_steps(paths.join(run_dir, "checkpoints"))
    if step is None and not steps:
        raise CheckpointError(f"the run {run_dir} has no complete checkpoint yet (checkpoints/ holds no finished step)")
    if step is not None and step not in steps:
        raise CheckpointError(f"{path} is not a complete checkpoint; the run {run_dir} has steps {steps}")
    step = steps[-1] if step is None else step
    return RunStep(run_dir, step, paths.join(run_dir, "checkpoints", str(step)), _config(run_dir).get("data", {}).get("tokenizer"))


class StateParams:
    """The one reader of a step's model weights: the parameters and router biases in the train
    state Orbax wrote (`state/params/...`, `state/router_bias/...`). `key(path)` is where parameter
    `path` lives in the item; `read(path, index)` one slice of it (`orbax_layout.ItemReader`),
    nothing else restored; `check()` reads them back against the step's checksums."""

    def __init__(self, run: RunStep):
        self.run = run
        self.reader = orbax_layout.ItemReader(run.step_dir, "state")
        self.dir = self.reader.dir
        self.keys = set(self.reader.arrays)

    def key(self, path: tuple[str, ...]) -> tuple[str, ...]:
        for kind in ("params", "router_bias"):  # the TrainState fields that hold the model
            if (kind, *path) in self.keys:
                return (kind, *path)
        raise CheckpointError(f"{self.dir} has no parameter {'.'.join(path)} (params/ or router_bias/); "
                              "does model_config.json belong to this run?")

    def read(self, path: tuple[str, ...], index=()) -> np.ndarray:
        return self.reader.read(self.key(path), index)

    def check(self, names=None) -> None:
        """Reads the parameters and router biases (or the arrays `names`) back against the step's
        checksums (`integrity`); a step saved before they were recorded is used as it is."""
        manifest = integrity.read_manifest(self.run.step_dir)
        if manifest is not None:
            model = [n for n in manifest if n.split(".")[0] in ("params", "router_bias")]
            self.reader.check(self.run.step, manifest, model if names is None else names)

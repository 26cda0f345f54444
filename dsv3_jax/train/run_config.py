"""One config story for a run's model: which `ModelConfig` fields say how to run it and which say
what it is, and how a start or a resume combines the command line with what the run already is.

- Run fields (`RUN_FIELDS`: dtypes, kernels and implementation switches, the expert capacity factor
  and exchange, remat, the pipeline schedule) come from the command line's config.model, always:
  on a fresh start, with --init_from, and on a resume, where a change from the run's record is
  applied and logged.
- Model fields (every other field: shapes, vocabulary, layers, experts, MTP depth, rope) are
  fixed once a run exists. A resume takes them from the run's record (model_config.json), and a
  command line that asks for another value is an error naming the field and both values; with
  --init_from the checkpoint's architecture replaces config.model's (a different value is logged),
  except DeepSeek Sparse Attention's indexer fields when config.model sets them (DSA's training
  stages: a V3.1-shaped source gets a fresh indexer, a warm-up run its sparse `index_topk`).
"""

from __future__ import annotations

import dataclasses

from dsv3_jax.config import ModelConfig

# Fields that change how the model is computed or stored, never which function it is.
RUN_FIELDS = ("param_dtype", "compute_dtype", "moe_impl", "moe_tile_size", "attention_impl", "fp8_matmul",
              "head_loss_impl", "expert_capacity_factor", "expert_exchange", "remat", "unroll_max_layers",
              "pipeline_microbatches", "pipeline_repeats", "pipeline_schedule")
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUN_FIELDS)


class ModelChanged(ValueError):
    """A resumed run's command line asks for another model than the run trains."""


def run_fields(cfg: ModelConfig) -> dict:
    return {name: getattr(cfg, name) for name in RUN_FIELDS}


def differences(was: ModelConfig, now: ModelConfig, fields: tuple[str, ...]) -> list[tuple[str, object, object]]:
    """(field, value in `was`, value in `now`) for each of `fields` that differs."""
    return [(name, getattr(was, name), getattr(now, name)) for name in fields
            if getattr(was, name) != getattr(now, name)]


def for_resume(record: ModelConfig, requested: ModelConfig, *, from_checkpoint: bool) -> ModelConfig:
    """The model a resumed run trains: the record's model fields with the requested run fields.

    `from_checkpoint`: the run was started with --init_from, whose architecture replaced config.model
    (so config.model's model fields say nothing). Otherwise a model field that differs is a
    ModelChanged naming it, and both values."""
    if not from_checkpoint:
        for name, was, now in differences(record, requested, MODEL_FIELDS):
            raise ModelChanged(f"config.model.{name}={now!r} but the run being resumed has {name}={was!r} "
                               "(model_config.json): a run keeps its architecture; use a new --workdir, "
                               "or --init_from=<this run> to start a new run from its weights")
    return record.replace(**run_fields(requested))

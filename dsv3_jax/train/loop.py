"""The training loop: (re)starts a run from its config, steps, evaluates, logs and checkpoints.

`train(config)` takes the ml_collections config of experiments/configs/ (experiments/train.py is
its command line): it resumes from the run folder's latest checkpoint (parameters, optimizer,
router biases, step, RNG and data position) or starts from config.train.init_from's weights or a
fresh init; writes WORKDIR/metrics.jsonl, tensorboard/, config.json and model_config.json (process
0) and Orbax checkpoints in WORKDIR/checkpoints (every process its shards). Non-finite steps are
skipped by the step itself; the loop stops after train.max_consecutive_skips of them in a row, never
saves a checkpoint while skipping, and stops at once when the first step after a restore is
non-finite (the restored checkpoint is suspect). SIGTERM makes every process save at one agreed
step and return.
"""

from __future__ import annotations

import itertools
import json
import logging as std_logging
import os
import time
from typing import Iterator

import jax
import numpy as np
from absl import logging
from flax import nnx

from sharding import multihost
from dsv3_jax import ConfigError, DeepSeekV3, ModelConfig, host, load_pretrained, paths
from dsv3_jax.config import INDEXER_FIELDS
from dsv3_jax.data import DataConfig, load_tokenizer, make_dataset, make_train_and_eval
from dsv3_jax.train import balancing, checkpointing, metrics as metrics_lib, optimizer as optimizer_lib
from dsv3_jax.train import finetune, run_config, sharded, state as state_lib, step as step_lib


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps in a row)."""


def quiet_checkpoint_logs():
    """Orbax logs a dozen INFO lines per checkpoint through absl; keep its warnings only."""
    def keep(record) -> bool:
        return record.levelno >= std_logging.WARNING or "orbax" not in record.pathname

    logging.get_absl_handler().addFilter(keep)


def enable_compilation_cache(path: str):
    """Persistent XLA cache: a restarted run (resume, a repeated test) skips the minutes of compiling."""
    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def model_config(config) -> ModelConfig:
    return ModelConfig.from_dict(config.model.to_dict())


def resolve_model(config, workdir: str, resume: bool) -> tuple[ModelConfig, DeepSeekV3 | None]:
    """(the model config that runs, the --init_from weights or None); see dsv3_jax/train/run_config.py.

    A resume keeps the run's architecture (model_config.json; another one asked for is a ModelChanged)
    and applies config.model's run fields, logging each change. --init_from loads the checkpoint's
    architecture with config.model's run fields, and config.model's lightning indexer when it has one."""
    requested = host.tune_model(model_config(config))
    if resume:
        record = ModelConfig.from_dict(json.loads(paths.at(paths.join(workdir, "model_config.json")).read_text()))
        cfg = run_config.for_resume(record, requested, from_checkpoint=bool(config.train.init_from))
        for name, was, now in run_config.differences(record, cfg, run_config.RUN_FIELDS):
            logging.warning("resume with a changed run field: config.model.%s=%r (was %r in the run's "
                            "model_config.json)", name, now, was)
        return cfg, None
    if config.train.init_from:
        model = build_model(config, requested)
        for name, asked, used in run_config.differences(requested, model.config, run_config.MODEL_FIELDS):
            logging.info("config.model.%s=%r ignored: %s has %s=%r", name, asked, config.train.init_from, name, used)
        return model.config, model
    return requested, None


def build_model(config, cfg: ModelConfig) -> DeepSeekV3:
    """The weights of config.train.init_from, each parameter loaded shard by shard where it will live,
    under the checkpoint's architecture and `cfg`'s run fields (dtypes, kernels, exchange, ...)."""
    init_from = finetune.base_of(config.train.init_from)  # a PEFT folder: its base (adapters: finetune.adapt)
    logging.info("initialising from %s: its architecture replaces config.model; the run fields (%s) come "
                 "from config.model", init_from, ", ".join(run_config.RUN_FIELDS))
    run = run_config.run_fields(cfg)
    if cfg.has_indexer:  # DSA's stages: config.model's indexer (a source without one gets it fresh)
        run.update({name: getattr(cfg, name) for name in INDEXER_FIELDS})
    # On a mesh each process reads only the shards its devices hold, placed as training places them.
    mesh = sharded.config_mesh(config)
    return load_pretrained(init_from, dtype=run.pop("param_dtype"), mesh=mesh if mesh.size > 1 else None,
                           rules=config.mesh.get("rules", "default"), **finetune.base_load_kwargs(config, mesh.size),
                           **run)


def start_state(config, cfg: ModelConfig, model: DeepSeekV3 | None, ckpt: checkpointing.Checkpointer | None,
                train_iter):
    """(graphdef, optimizer, train state, MeshTraining or None, trainable mask or None): the state built
    abstractly, its shardings from the rules (one device without a mesh), then made shard by shard:
    restored from `ckpt` (a resume; `train_iter` moved to the saved position), from `model`'s weights
    (--init_from, loaded per shard) or a fresh init under jit. No path holds a whole sharded leaf on
    one device or host. With `config.lora` the model carries adapters and only they train."""
    tc = config.train

    def make_model(log: bool = False):  # a new Rngs each call: eval_shape and the jitted init draw the same numbers
        fresh = finetune.quantize_base(config, DeepSeekV3(cfg, rngs=nnx.Rngs(tc.seed)))  # QLoRA: as loaded
        finetune.adapt(config, fresh, read_peft=False, log=log)
        return fresh

    abstract_model = nnx.eval_shape(lambda: make_model(log=True))
    _, params, _ = state_lib.split_model(abstract_model)
    trainable = finetune.trainable(config, params)
    decay = optimizer_lib.select(optimizer_lib.decay_mask(params), trainable)
    tx = optimizer_lib.make_optimizer(config.optimizer, tc.steps, decay)
    graphdef, abstract = state_lib.abstract_train_state(abstract_model, tx, tc.seed, trainable)
    on_mesh = sharded.for_config(config, abstract_model, abstract)
    if on_mesh is not None:
        logging.info("mesh %s, rules %r", dict(on_mesh.mesh.shape), config.mesh.rules)
    shardings = on_mesh.shardings if on_mesh is not None else state_lib.on_one_device(abstract)
    if ckpt is not None:
        state = ckpt.restore(checkpointing.abstract_like(abstract, shardings), train_iter)
        host.trim_heap()  # the restore's host copies, before the first step's buffers
        logging.info("resumed from %s at step %d", ckpt.manager.directory, int(state.step))
    elif model is not None:
        finetune.adapt(config, model)  # LoRA: adapters on the loaded weights (a PEFT --init_from: read)
        state = state_lib.train_state_from(model, tx, tc.seed, shardings, donate=True, trainable=trainable)
    else:
        state = state_lib.fresh_train_state(make_model, tx, tc.seed, shardings, trainable,
                                            compiler_options=host.init_compiler_options())
    return graphdef, tx, state, on_mesh, trainable


def make_data(config, vocab_size: int) -> tuple[Iterator[dict], dict]:
    """(train iterator, {record key: held-out dataset}): the eval split of the run's data as
    `eval_loss` and, with data.pretrain_eval, the held-out split of the pretraining corpus
    (data.pretrain_path, as text: the same hash split a pretraining run on it holds out) as
    `pretrain_eval_loss`. Rows of data.seq_len + 1 tokens (inputs and their next-token targets); the
    pipeline checks every token id against the vocab."""
    d = config.data
    tokenizer = load_tokenizer(d.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"config.model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size} ids, {d.tokenizer or 'bundled tokenizer'})")
    rows = dict(seq_len=d.seq_len + 1, batch_size=d.batch_size, tokenizer=d.tokenizer, add_bos=d.add_bos)
    run_data = DataConfig(**rows, data=d.path, text_field=d.text_field, eval_fraction=d.eval_fraction, seed=d.seed,
                          num_workers=d.num_workers, format=d.format, chat_template=d.chat_template)
    train_ds, eval_ds = make_train_and_eval(run_data, tokenizer=tokenizer)
    eval_sets = {"eval_loss": eval_ds}
    if d.pretrain_eval:
        pretrain = DataConfig(**rows, data=d.pretrain_path, eval_fraction=d.pretrain_eval_fraction)
        eval_sets["pretrain_eval_loss"] = make_dataset(pretrain, "eval")
    return iter(train_ds), eval_sets


def evaluate(eval_step, state, eval_sets: dict, max_batches: int) -> dict:
    """{record key: mean next-token loss over that held-out split (at most max_batches batches)}."""
    losses = {}
    for key, dataset in eval_sets.items():
        total, count = 0.0, 0.0
        for batch in itertools.islice(dataset, max_batches):
            nll, n = eval_step(state, batch)
            total, count = total + float(nll), count + float(n)
        losses[key] = total / max(count, 1.0)
    return losses


def load_record(counts_LxE) -> dict:
    """MaxVio per layer and the per-expert load shares (for the heatmap) of one step's counts."""
    counts = np.asarray(counts_LxE, np.float64)
    share = counts / np.maximum(counts.sum(axis=-1, keepdims=True), 1.0)
    return {"maxvio": np.asarray(balancing.max_violation(counts)).tolist(), "expert_load": share.round(5).tolist()}


def train(config) -> list[dict]:
    """Runs (or resumes) the training described by `config`; returns the records it logged."""
    tc = config.train
    enable_compilation_cache(tc.compilation_cache)
    workdir = paths.resolve(tc.workdir)  # a local folder or a URL (gs://bucket/run): dsv3_jax/paths.py
    paths.makedirs(workdir)
    lead = jax.process_index() == 0  # writes the run's files; every process saves its checkpoint shards
    ckpt = checkpointing.Checkpointer(paths.join(workdir, "checkpoints"), every=tc.checkpoint_every,
                                      keep=tc.keep_checkpoints, async_save=not host.on_cpu())
    resume = ckpt.manager.latest_step() is not None
    cfg, model = resolve_model(config, workdir, resume)
    if config.loss.get("indexer_weight", 0.0) and not cfg.has_indexer:
        raise ConfigError(f"config.loss.indexer_weight={config.loss.indexer_weight} trains the lightning indexer, "
                          "which this model has none of: set config.model.index_n_heads, index_head_dim, index_topk")
    if lead:
        _write_run_files(workdir, config, cfg)
    train_iter, eval_sets = make_data(config, cfg.vocab_size)
    graphdef, tx, state, on_mesh, trainable = start_state(config, cfg, model, ckpt if resume else None, train_iter)
    del model  # its weights now live in the state (donated)
    start = int(state.step)
    train_step, eval_step, first_batch = _make_steps(config, graphdef, tx, on_mesh, trainable, state, train_iter,
                                                     start)
    writer = metrics_lib.MetricsWriter(workdir, resume_step=start) if lead else _NoWriter()
    log = _StepLog(config, cfg, start, writer, lambda st: evaluate(eval_step, st, eval_sets, tc.eval_batches))
    try:
        # The starting model, before a fine-tune: the baseline of what it forgets of its pretraining.
        if start == 0 and "pretrain_eval_loss" in eval_sets and tc.eval_every:
            log.baseline(state)
        with checkpointing.preemption() as preempted:
            previous = None  # (the step before, its metrics), checked once this step is queued
            for step in range(start + 1, tc.steps + 1):
                batch, first_batch = (next(train_iter) if first_batch is None else first_batch), None
                state, m = train_step(state, batch)  # the only reference: the step donates its input
                if resume and step == start + 1:
                    _check_restored(start, m)
                if previous is not None:  # reading a value waits for its step: one step late keeps one in flight
                    _check_skips(*previous, tc.max_consecutive_skips)
                previous = (step, m)  # the metrics, not the state: the next step donates the state's buffers
                log.step(step, m, state)
                stop = preempted(step)  # the same step on every process
                saved = _save(ckpt, step, state, train_iter, m, force=step == tc.steps or stop)
                if stop:
                    logging.warning("SIGTERM: %s at step %d; exiting", "saved a checkpoint" if saved else
                                    "no checkpoint (a non-finite step)", step)
                    break
            if previous is not None:
                _check_skips(*previous, tc.max_consecutive_skips)
    finally:
        ckpt.close()
        writer.close()
    return log.records


def _write_run_files(workdir: str, config, cfg: ModelConfig) -> None:
    """config.json and model_config.json: what runs, the resolved model (the architecture of the run or
    checkpoint, the run fields asked for)."""
    record = json.loads(config.to_json_best_effort())
    record["model"] = cfg.to_dict()
    paths.write_text(paths.join(workdir, "config.json"), json.dumps(record, indent=2))
    paths.write_text(paths.join(workdir, "model_config.json"), json.dumps(cfg.to_dict(), indent=2))


def _make_steps(config, graphdef, tx, on_mesh, trainable, state, train_iter, start: int):
    """(train step, eval step, a batch drawn before the loop or None). The state is donated on every
    platform: the loop reads nothing from a state once the next step has it (on CPU saves are
    synchronous: an async save's host views would keep the buffers alive)."""
    schedule = optimizer_lib.make_schedule(config.optimizer, config.train.steps)
    step_kwargs = dict(mtp_weight=config.loss.mtp_weight, balance_weight=config.loss.balance_weight,
                       bias_update_speed=config.balancing.bias_update_speed, trainable=trainable, donate=True,
                       indexer_weight=config.loss.get("indexer_weight", 0.0))
    eval_step = step_lib.make_eval_step(graphdef)
    if on_mesh is None:
        return step_lib.make_train_step(graphdef, tx, schedule, **step_kwargs), eval_step, None
    mesh_step = sharded.make_sharded_train_step(graphdef, tx, schedule, on_mesh.shardings, on_mesh.mesh,
                                                on_mesh.rules, **step_kwargs)
    first_batch = None
    if jax.process_count() > 1 and host.on_cpu() and start < config.train.steps:
        # XLA:CPU's collectives (gloo) give a process 30 s to join the first one, and processes
        # sharing a machine's cores finish compiling the step minutes apart: compile, then meet.
        first_batch = next(train_iter)
        mesh_step.compile(state, on_mesh.place_batch(first_batch))
        host.trim_heap()  # the compiler's freed heap, before the step's buffers
        multihost.barrier("train_step_compiled")
    return on_mesh.placing(mesh_step), on_mesh.placing(eval_step), first_batch


class _StepLog:
    """Logs every train.log_every steps (and the last): the metrics, throughput and MFU over the window
    since the last record, held-out losses every train.eval_every, a console line with rate and ETA."""

    def __init__(self, config, cfg: ModelConfig, start: int, writer, evaluate_state):
        tc = config.train
        self.tc, self.writer, self.evaluate_state, self.records = tc, writer, evaluate_state, []
        self.tokens_per_step = config.data.batch_size * config.data.seq_len * jax.process_count()
        self.flops_per_step = metrics_lib.flops_per_token(cfg, config.data.seq_len) * self.tokens_per_step
        peak, peak_source = metrics_lib.peak_flops_per_device(tc.peak_flops_per_device)
        self.peak = peak * jax.device_count()
        counts = cfg.param_counts()
        logging.info("model: %.2fM parameters (%.2fM activated, MTP %.2fM); %d tokens/step; peak %.3g FLOP/s (%s)",
                     counts["total"] / 1e6, counts["activated"] / 1e6, counts["mtp"] / 1e6, self.tokens_per_step,
                     self.peak, peak_source)
        self.progress = metrics_lib.Progress(tc.steps)
        self.window_start, self.t_window = start, time.perf_counter()

    def baseline(self, state) -> None:
        """Step 0's held-out losses, before the first step (the window's clock starts after them)."""
        record = {"step": 0, **self.evaluate_state(state)}
        logging.info("step 0 (before training) | eval %.4f | pretrain-eval %.4f", record["eval_loss"],
                     record["pretrain_eval_loss"])
        self.writer.write(record)
        self.records.append(record)
        self.t_window = time.perf_counter()

    def step(self, step: int, m, state) -> None:
        tc = self.tc
        if step % tc.log_every and step != tc.steps:
            return
        record = _record(step, m, state, self.window_start, self.t_window, self.tokens_per_step, self.flops_per_step,
                         self.peak)
        if tc.eval_every and (step % tc.eval_every == 0 or step == tc.steps):
            record |= self.evaluate_state(state)
        steps_per_sec, eta = self.progress.tick(step)
        _console(record, tc.steps, steps_per_sec, eta)
        self.writer.write(record)
        self.records.append(record)
        self.window_start, self.t_window = step, time.perf_counter()


def _save(ckpt: checkpointing.Checkpointer, step: int, state, train_iter, m, *, force: bool) -> bool:
    """Saves `step` when due, unless it was skipped as non-finite: a checkpoint of a run that is
    diverging would take the place of an intact one in the rotation. Returns whether it saved."""
    if step % ckpt.every and not force:
        return False
    if int(m["consecutive_skips"]):  # the same value on every process (a global loss)
        logging.warning("step %d skipped a non-finite step (%d in a row): no checkpoint saved",
                        step, int(m["consecutive_skips"]))
        return False
    saved = ckpt.save(step, state, train_iter)
    host.trim_heap()  # the save's host copies, before the next step's buffers
    return saved


def _check_restored(restored_step: int, m) -> None:
    """The first step after a restore must be finite: a non-finite one there points at the restored
    state itself (damaged, or saved by a run already diverging), not at the data or learning rate."""
    if int(m["consecutive_skips"]):
        raise TrainingError(
            f"step {restored_step + 1}, the first after restoring the checkpoint of step {restored_step}, had a "
            f"non-finite loss or gradient (loss {float(m['loss'])}, grad norm {float(m['grad_norm'])}): the "
            f"checkpoint of step {restored_step} is suspect; stopping without saving.")


def _check_skips(step: int, m, limit: int):
    consecutive = int(m["consecutive_skips"])
    if consecutive >= limit:
        raise TrainingError(
            f"{consecutive} steps in a row (up to step {step}) had a non-finite loss or gradient "
            f"(last loss {float(m['loss'])}, grad norm {float(m['grad_norm'])}); stopping. Lower "
            f"config.optimizer.peak_lr or check the data; train.max_consecutive_skips={limit}.")


class _NoWriter:
    """Processes other than 0 log to the console only."""

    def write(self, record):
        pass

    def close(self):
        pass


def _record(step, m, state, window_start, t_window, tokens_per_step, flops_per_step, peak) -> dict:
    record = {"step": step}
    for key in ("loss", "lm_loss", "mtp_loss", "balance_loss", "indexer_loss", "grad_norm", "lr", "dropped_fraction"):
        if key in m:  # indexer_loss: only while the lightning indexer trains
            record[key] = float(m[key])  # waits for this step: the window's clock stops after it, not at dispatch
    seconds = max(time.perf_counter() - t_window, 1e-9)
    steps = step - window_start
    record["tokens_per_sec"] = steps * tokens_per_step / seconds
    record["mfu"] = steps * flops_per_step / seconds / peak
    record["skipped_steps"] = int(state.skipped)
    if "expert_counts" in m:
        record.update(load_record(m["expert_counts"]))
    if "mtp_expert_counts" in m:
        record["mtp_maxvio"] = load_record(m["mtp_expert_counts"])["maxvio"]
    return record


# The console line's fields, in order: record key, format of its value (keys not in the record are left out).
_CONSOLE = (("loss", "loss {:.4f}"), ("lm_loss", "lm {:.4f}"), ("mtp_loss", "mtp {:.4f}"),
            ("indexer_loss", "indexer kl {:.4f}"), ("eval_loss", "eval {:.4f}"),
            ("pretrain_eval_loss", "pretrain-eval {:.4f}"), ("maxvio", "maxvio {:.3f}"), ("grad_norm", "gnorm {:.3f}"),
            ("lr", "lr {:.3g}"), ("tokens_per_sec", "{:.0f} tok/s"), ("mfu", "mfu {:.2%}"))


def _console(record, total_steps, steps_per_sec, eta):
    shown = dict(record, maxvio=np.mean(record["maxvio"])) if "maxvio" in record else record
    parts = [f"step {record['step']}/{total_steps}"]
    parts += [fmt.format(shown[key]) for key, fmt in _CONSOLE if key in shown]
    if record["skipped_steps"]:
        parts.append(f"skipped {record['skipped_steps']}")
    if np.isfinite(eta):
        parts.append(f"{steps_per_sec:.2f} step/s, ETA {metrics_lib.format_duration(eta)}")
    logging.info(" | ".join(parts))

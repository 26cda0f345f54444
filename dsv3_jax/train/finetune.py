"""Fine-tuning set-up for the trainer: LoRA adapters from `config.lora` (QLoRA: over a base held
quantized, `lora.base_weights`), `--init_from` a PEFT LoRA folder (its base model, then its
adapters), and `train.trainable="indexer"`: only the lightning indexers learn (DSA's dense warm-up)."""

from __future__ import annotations

import os

from absl import logging
from flax import nnx

from dsv3_jax.checkpoint import lora_export
from dsv3_jax.config import ConfigError
from dsv3_jax.model import lora
from dsv3_jax.model import quant as model_quant
from dsv3_jax.train import optimizer


def base_of(init_from: str | None) -> str | None:
    """What to load the weights from: the base model of a PEFT folder, else `init_from` itself."""
    if not init_from or not lora_export.is_peft_folder(init_from):
        return init_from
    base = lora_export.peft_lora_config(init_from)["base"]
    if not base or not os.path.exists(base):
        raise ValueError(f"--init_from={init_from} is a PEFT adapter whose base_model_name_or_path ({base!r}) is "
                         "no local folder; set it to the base model's HF folder (or a run of ours)")
    return base


def lora_config(config) -> lora.LoRAConfig | None:
    return lora.LoRAConfig(**config.lora.to_dict()) if "lora" in config else None


def base_load_kwargs(config, mesh_size: int) -> dict:
    """`load_pretrained` arguments for the base: with `lora.base_weights` (QLoRA) it loads quantized."""
    cfg = lora_config(config)
    if cfg is None or not cfg.quantized:
        return {}
    if mesh_size > 1:
        raise ValueError(f"lora.base_weights={cfg.base_weights!r} (QLoRA) trains on one device; the quantized "
                         "base's shardings are not derived for a training mesh: set config.mesh sizes to 1")
    return cfg.load_kwargs()


def quantize_base(config, model: nnx.Module) -> nnx.Module:
    """A model built here (fresh or abstract) held as a QLoRA run loads its base: quantized as
    `lora.base_weights` says (in place); as is otherwise. Same leaves as `load_pretrained(weights=)`."""
    cfg = lora_config(config)
    if cfg is not None and cfg.quantized:
        model_quant.quantize_model(model, cfg.base_weights, cfg.base_quantize)
    return model


TRAINABLE = ("all", "indexer")


def trainable(config, params: nnx.State) -> dict | None:
    """The mask of the parameters that train: with a `config.lora` section the adapters; with
    `train.trainable="indexer"` the lightning indexers'; else None (all)."""
    which = config.train.get("trainable", "all")
    if which not in TRAINABLE or which != "all" and "lora" in config:
        raise ConfigError(f"config.train.trainable={which!r} must be one of {TRAINABLE} ('all' with a config.lora "
                         "section, whose adapters are what trains)")
    if "lora" in config:
        return optimizer.trainable_mask(params, nnx.LoRAParam)
    return optimizer.trainable_mask(params, "indexer") if which == "indexer" else None


def adapt(config, model: nnx.Module, *, read_peft: bool = True, log: bool = False) -> None:
    """With a `config.lora` section: LoRA adapters on the model (in place; read from a PEFT
    `--init_from` when `read_peft`, not on an abstract model). `log`: say which weights carry
    adapters (the trainer adapts several copies of the model; one of them says it)."""
    if "lora" not in config:
        return
    fields = config.lora.to_dict()
    init_from = config.train.init_from
    peft = init_from if init_from and lora_export.is_peft_folder(init_from) else None
    if peft:  # the run's config (and so its export) must say what the adapter is
        for field, value in lora_export.peft_lora_config(peft).items():
            if field != "base" and value != fields[field]:
                raise ValueError(f"config.lora.{field}={fields[field]} differs from the PEFT adapter's {value} "
                                 f"({peft}/adapter_config.json); pass --config.lora.{field}={value}")
    targets = lora.apply(model, lora_config(config))
    if log:
        logging.info("LoRA rank %d on %d weights: %s", fields["rank"], len(targets), ", ".join(targets))
    if peft and read_peft:
        logging.info("adapters from %s: %d modules", peft, len(lora_export.import_peft(model, peft)))


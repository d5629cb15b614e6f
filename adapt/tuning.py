"""Full fine-tuning, LoRA and QLoRA (peft + bitsandbytes), and merging LoRA back for export."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from adapt.arch import facts_for
from adapt.config import TuningConfig
from adapt.errors import ConfigError

log = logging.getLogger(__name__)


def lora_targets(model, tuning: TuningConfig):
    if tuning.target_modules == "registry":
        return facts_for(model.config).lora_targets
    return tuning.target_modules  # "all-linear" or an explicit list


def apply_tuning(model, tuning: TuningConfig, *, new_token_ids: list[int] = ()):
    """Make ``model`` trainable as ``tuning`` says; returns the model to train (maybe a PeftModel).

    ``new_token_ids``: rows of the embedding added for this run (a new mask token). Under LoRA they
    stay trainable through peft's ``trainable_token_indices`` so the new token can be learned.
    """
    if tuning.method == "full":
        model.requires_grad_(True)
        if tuning.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if tuning.method == "qlora":
        if not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None:
            raise ConfigError("tuning.method=qlora needs a model loaded with quantization (load_decoder(..., tuning))")
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=tuning.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif tuning.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    config = LoraConfig(
        r=tuning.lora_r, lora_alpha=tuning.lora_alpha, lora_dropout=tuning.lora_dropout,
        target_modules=lora_targets(model, tuning), bias="none",
        trainable_token_indices=list(new_token_ids) or None,
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"LoRA could not attach to this model ({e}); set tuning.target_modules=all-linear "
                          "or list module names") from None
    return peft_model


def trainable_parameters(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def merged_model(model, tuning: TuningConfig, *, adapter_dir: Path | None = None, load_base=None):
    """A plain transformers model with LoRA merged in, ready to save.

    LoRA: ``merge_and_unload``. QLoRA: merging into 4/8-bit weights loses precision, so the base is
    reloaded unquantized through ``load_base()`` and the saved adapter is merged into it.
    """
    if tuning.method == "full":
        return model
    if tuning.method == "lora":
        return model.merge_and_unload()
    from peft import PeftModel

    if adapter_dir is None or load_base is None:
        raise ConfigError("merging a QLoRA adapter needs the saved adapter and a way to reload the base unquantized")
    base = load_base()
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    return merged.to(torch.float32) if merged.dtype != torch.float32 and base.device.type == "cpu" else merged

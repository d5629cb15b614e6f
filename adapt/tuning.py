"""Full fine-tuning, LoRA and QLoRA (peft + bitsandbytes), and merging LoRA back for export."""
from __future__ import annotations

import logging
import shutil
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


def apply_tuning(model, tuning: TuningConfig, *, new_token_ids: list[int] = (), modules_to_save: list[str] = ()):
    """Make ``model`` trainable as ``tuning`` says; returns the model to train (maybe a PeftModel).

    ``new_token_ids``: rows of the embedding added for this run (a new mask token). Under LoRA they
    stay trainable through peft's ``trainable_token_indices`` so the new token can be learned.
    ``modules_to_save``: modules trained in full under LoRA (peft's ``modules_to_save``), e.g. a new
    classification head ``score``; merging puts the trained copy in place.
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
    if tuning.method == "qlora" and tuning.kbit_fp32 == "all":  # peft's preparation, checkpointing included
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=tuning.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        if tuning.method == "qlora":
            prepare_kbit_lean(model, tuning.kbit_fp32)
        if tuning.gradient_checkpointing:  # inputs require grad, so the gradient reaches adapters past frozen layers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
    config = LoraConfig(
        r=tuning.lora_r, lora_alpha=tuning.lora_alpha, lora_dropout=tuning.lora_dropout,
        target_modules=lora_targets(model, tuning), bias="none",
        trainable_token_indices=list(new_token_ids) or None, modules_to_save=list(modules_to_save) or None,
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"LoRA could not attach to this model ({e}); set tuning.target_modules=all-linear "
                          "or list module names") from None
    return peft_model


def _cast_to_weight_dtype(module, args):
    hidden = args[0]
    if hidden.dtype != module.weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        return (hidden.to(module.weight.dtype), *args[1:])
    return None


def prepare_kbit_lean(model, mode: str = "auto") -> str:
    """peft's ``prepare_model_for_kbit_training`` without doubling the big frozen tensors; the mode used.

    peft casts every frozen weight that is not quantized to fp32, for fp16 stability. In a decoder
    those are the norms and biases (small) and the embeddings and LM head (a 49k x 1024 vocabulary
    is 200 MB in fp32, more than the 4-bit layers of a 0.5B model). ``norms``: only the 1-D ones
    (norms, biases) go to fp32, as peft would make them; the embeddings and head keep the loaded
    dtype. ``none``: nothing is cast. fp32 norms make the residual stream fp32 (each 4-bit layer
    returns its input's dtype), which costs memory and time and buys nothing in bf16, whose range is
    fp32's (the RMS itself is computed in fp32 by the models). ``auto`` is ``norms`` for a model
    loaded in float16 and ``none`` otherwise. Everything is frozen, as peft does;
    :func:`apply_tuning` then turns on gradient checkpointing as for LoRA.
    """
    model.requires_grad_(False)
    small = [p for p in model.parameters()
             if p.ndim == 1 and p.dtype in (torch.float16, torch.bfloat16) and type(p).__name__ != "Params4bit"]
    if mode == "auto":
        mode = "norms" if any(p.dtype == torch.float16 for p in small) else "none"
    if mode == "none":
        return mode
    for param in small:
        param.data = param.data.float()
    head = model.get_output_embeddings()
    if head is not None:  # the residual stream is fp32 after the fp32 norms; the head keeps its dtype
        head.register_forward_pre_hook(_cast_to_weight_dtype)
    return mode


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


def save_adapter_and_merge(model, tuning: TuningConfig, run_dir: Path, load_base):
    """End of a run: save the LoRA adapter to ``run_dir/adapter`` (LoRA/QLoRA), return the merged model."""
    adapter_dir = None
    if tuning.method != "full":
        adapter_dir = Path(run_dir) / "adapter"
        shutil.rmtree(adapter_dir, ignore_errors=True)
        model.save_pretrained(str(adapter_dir), safe_serialization=True)
    return merged_model(model, tuning, adapter_dir=adapter_dir, load_base=load_base)

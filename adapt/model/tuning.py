"""Full fine-tuning, LoRA and QLoRA (peft + bitsandbytes), and merging LoRA back for export."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from adapt.model.families import MOE_LORA_TARGETS, facts_for, num_experts
from adapt.config.settings import TuningConfig
from adapt.errors import ConfigError

log = logging.getLogger(__name__)


def _is_linear(module) -> bool:
    # bitsandbytes' Linear4bit/Linear8bitLt are nn.Linear; GPT-2's Conv1D is a linear layer too
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def attention_linears(model) -> list[str]:
    """Name suffixes of the linear layers inside the attention modules, e.g. ``self_attn.q_proj``.

    Attention modules are found by transformers' naming convention (``Qwen3MoeAttention``, ...).
    """
    found = set()
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Attention"):
            parent = name.rpartition(".")[2]
            found.update(f"{parent}.{sub}" if parent else sub
                         for sub, child in module.named_modules() if sub and _is_linear(child))
    return sorted(found)


def lora_targets(model, tuning: TuningConfig):
    targets = tuning.target_modules
    if targets == "registry":
        targets = facts_for(model.config).lora_targets
    if targets == MOE_LORA_TARGETS:
        targets = attention_linears(model)
        if not targets:
            raise ConfigError("LoRA found no linear layer inside an attention module of this model: set "
                              f"tuning.target_modules to a list of module names ({_linear_names_hint(model)})")
    return targets  # "all-linear" or a list of module-name suffixes


def _linear_names_hint(model, most: int = 10) -> str:
    names = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if _is_linear(m)})
    return "its linear layers: " + ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def router_modules(model) -> list[str]:
    """Names of the routers of a mixture-of-experts model: the modules of its numbered layers, outside
    attention, whose weight maps a hidden state to one logit per expert (``mlp.gate``, ``mlp.router``,
    ``block_sparse_moe.router``, ...; a classifier head with as many labels is not one)."""
    n = num_experts(model.config)
    if not n:
        return []
    shape = (n, getattr(model.config.get_text_config(), "hidden_size", None))
    attention = tuple(name + "." for name, m in model.named_modules() if type(m).__name__.endswith("Attention"))
    return [name for name, module in model.named_modules()
            if isinstance(getattr(module, "weight", None), torch.Tensor) and tuple(module.weight.shape) == shape
            and not name.startswith(attention) and any(part.isdigit() for part in name.split("."))]


def freeze_routers(model, names: list[str]) -> None:
    """Freeze the routers ``names`` of an MoE and anything peft put on them (see :func:`adapt.model.families.num_experts`
    for why: under ``target_modules=all-linear`` peft may adapt a router too)."""
    for name in names:
        model.get_submodule(name).requires_grad_(False)
    if names:
        log.info("mixture of experts: its %d routers stay frozen", len(names))


def _lora_error(err: ValueError, model) -> ConfigError:
    if "lora_dropout" in str(err):  # peft's ParamWrapper: the fused expert weights of an MoE
        advice = ("the targets reach fused expert weights, which peft adapts only without dropout: set "
                  "tuning.lora_dropout=0 to train them, or tuning.target_modules=registry (attention only)")
    else:
        advice = (f"set tuning.target_modules to a list of module names ({_linear_names_hint(model)}) or "
                  "all-linear")
    return ConfigError(f"LoRA could not attach to this model ({err}); {advice}")


def apply_tuning(model, tuning: TuningConfig, *, new_token_ids: list[int] = (), modules_to_save: list[str] = ()):
    """Make ``model`` trainable as ``tuning`` says; returns the model to train (maybe a PeftModel).

    ``new_token_ids``: rows of the embedding added for this run (a new mask token). Under LoRA they
    stay trainable through peft's ``trainable_token_indices`` so the new token can be learned.
    ``modules_to_save``: modules trained in full under LoRA (peft's ``modules_to_save``), e.g. a new
    classification head ``score``; merging puts the trained copy in place.
    """
    routers = router_modules(model)  # named before peft wraps anything
    if tuning.method == "full":
        model.requires_grad_(True)
        freeze_routers(model, routers)
        if tuning.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if tuning.method == "qlora":
        if not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None:
            raise ConfigError("tuning.method=qlora needs a model loaded with quantization (load_decoder(..., tuning))")
        share = quantized_share(model)
        if num_experts(model.config) and share < 0.5:
            log.warning("QLoRA: bitsandbytes quantized only %.0f%% of this mixture-of-experts model's weights (its "
                        "linear layers); the fused expert weights stay in %s", 100 * share, model.dtype)
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
        raise _lora_error(e, model) from None
    freeze_routers(peft_model.get_base_model(), routers)
    return peft_model


def quantized_share(model) -> float:
    """The fraction of the model's weights (in values, not bytes) that bitsandbytes holds quantized."""
    quantized = total = 0
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            kind = type(param).__name__
            n = module.in_features * module.out_features if kind in ("Params4bit", "Int8Params") else param.numel()
            total += n
            quantized += n if kind in ("Params4bit", "Int8Params") else 0
    return quantized / max(total, 1)


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
        return _unmarked(model.merge_and_unload())
    from peft import PeftModel

    if adapter_dir is None or load_base is None:
        raise ConfigError("merging a QLoRA adapter needs the saved adapter and a way to reload the base unquantized")
    base = load_base()
    merged = _unmarked(PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload())
    return merged.to(torch.float32) if merged.dtype != torch.float32 and base.device.type == "cpu" else merged


def _unmarked(model):
    """peft 0.15 leaves ``peft_config`` on the model it merged into: a plain model has none."""
    if "peft_config" in vars(model):
        del model.peft_config
    return model


def save_adapter_and_merge(model, tuning: TuningConfig, run_dir: Path, load_base):
    """End of a run: save the LoRA adapter to ``run_dir/adapter`` (LoRA/QLoRA), return the merged model."""
    adapter_dir = None
    if tuning.method != "full":
        adapter_dir = Path(run_dir) / "adapter"
        shutil.rmtree(adapter_dir, ignore_errors=True)
        model.save_pretrained(str(adapter_dir), safe_serialization=True)
    return merged_model(model, tuning, adapter_dir=adapter_dir, load_base=load_base)

"""The one registry of per-family facts, keyed by ``config.model_type``.

Everything that differs between decoder families lives here and nowhere else. Families not listed
get :data:`DEFAULT_FACTS` (sdpa, all-linear LoRA, relative positions): the bidirectionality probe
then decides whether the conversion worked, so an unknown family is never trusted silently.
Adding a family is one entry in :data:`REGISTRY` plus one tiny config in ``tests/tiny.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

_ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class FamilyFacts:
    model_type: str
    lora_targets: tuple[str, ...] | str = "all-linear"
    """peft ``target_modules``: module-name suffixes, or ``"all-linear"``."""
    attn_implementations: tuple[str, ...] = ("sdpa", "eager")
    """Attention implementations under which ``is_causal=False`` is honoured; the first is preferred."""
    sliding_window: bool = False
    """The family can have sliding-window (local) layers; made full attention unless asked to keep them."""
    absolute_positions: bool = False
    """Learned absolute position embeddings: left padding needs ``position_ids`` from the attention mask."""
    mask_token_candidates: tuple[str, ...] = ()
    """Unused special tokens this family's tokenizers ship, tried (in order) as the mask token."""
    notes: str = field(default="", compare=False)


def _f(model_type: str, **kw) -> FamilyFacts:
    return FamilyFacts(model_type=model_type, **kw)


_LLAMA_RESERVED = ("<|reserved_special_token_0|>", "<|reserved_special_token_1|>")

REGISTRY: dict[str, FamilyFacts] = {f.model_type: f for f in [
    _f("llama", lora_targets=_ATTN_MLP, mask_token_candidates=_LLAMA_RESERVED),
    _f("mistral", lora_targets=_ATTN_MLP, sliding_window=True),
    _f("mixtral", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), sliding_window=True),
    _f("qwen2", lora_targets=_ATTN_MLP, sliding_window=True),
    _f("qwen3", lora_targets=_ATTN_MLP, sliding_window=True),
    _f("gemma", lora_targets=_ATTN_MLP, mask_token_candidates=("<unused0>", "<unused1>"),
       notes="use_bidirectional_attention is not honoured with padding; is_causal=False is"),
    _f("gemma2", lora_targets=_ATTN_MLP, attn_implementations=("eager",), sliding_window=True,
       mask_token_candidates=("<unused0>", "<unused1>"), notes="no SDPA; local layers alternate"),
    _f("gemma3_text", lora_targets=_ATTN_MLP, sliding_window=True, mask_token_candidates=("<unused0>",)),
    _f("phi3", lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), sliding_window=True),
    _f("phi", lora_targets=("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")),
    _f("gpt2", lora_targets=("c_attn", "c_proj", "c_fc"), absolute_positions=True),
    _f("gpt_bigcode", lora_targets=("c_attn", "c_proj", "c_fc"), absolute_positions=True),
    _f("gpt_neo", lora_targets=("q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj"),
       absolute_positions=True),
    _f("olmo", lora_targets=_ATTN_MLP),
    _f("olmo2", lora_targets=_ATTN_MLP),
    _f("granite", lora_targets=_ATTN_MLP),
    _f("stablelm", lora_targets=_ATTN_MLP, attn_implementations=("eager",),
       notes="its SDPA path ignores config.is_causal when there is no padding (found by the probe)"),
    _f("starcoder2", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"), sliding_window=True),
    _f("smollm3", lora_targets=_ATTN_MLP, mask_token_candidates=_LLAMA_RESERVED),
]}

DEFAULT_FACTS = FamilyFacts(model_type="default")


def facts_for(config_or_model) -> FamilyFacts:
    """Facts for a config, a model, or a model_type string; unknown families get the defaults."""
    if isinstance(config_or_model, str):
        model_type = config_or_model
    else:
        config = getattr(config_or_model, "config", config_or_model)
        model_type = getattr(config, "model_type", "")
    if model_type in REGISTRY:
        return REGISTRY[model_type]
    return dataclasses.replace(DEFAULT_FACTS, model_type=model_type or "unknown")


def preferred_attention(config_or_model) -> str:
    """The attention implementation under which this family honours ``is_causal=False``."""
    return facts_for(config_or_model).attn_implementations[0]

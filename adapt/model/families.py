"""The one registry of per-family facts, keyed by ``config.model_type``.

Everything that differs between decoder families lives here and nowhere else. Families not listed
get :data:`DEFAULT_FACTS` (sdpa, all-linear LoRA, relative positions): the bidirectionality probe
then decides whether the conversion worked, so an unknown family is never trusted silently.
Adding a family is one entry in :data:`REGISTRY` plus one tiny config in ``tests/tiny.py``.

Mixture-of-experts decoders are recognised by their config (:func:`num_experts`), not by name: unless
their entry names LoRA targets, they get :data:`MOE_LORA_TARGETS`, the linear layers of attention.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

_ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

MOE_LORA_TARGETS = "attention"
"""LoRA targets of a mixture-of-experts decoder: every linear layer inside its attention modules.

Why not the experts: transformers 5 stores them fused, one 3-D parameter per projection for all
experts. peft adapts those only through ``target_parameters`` (peft >= 0.17), only with
``lora_dropout=0`` for the whole adapter, and by materialising W + BA for every expert of a layer on
each forward, kept for the backward pass (measured on peft 0.21.2, a 2-layer Qwen3-MoE with 8
experts: a step 1.33x the attention-only one, 6.7x its trainable parameters). bitsandbytes leaves
those parameters unquantized as well, so on a real MoE adapting them costs what QLoRA is meant to
save. Attention is what the bidirectional mask changes, and this works on every peft the project
admits, with the configured dropout. The router is never trained (see :func:`num_experts`).
``tuning.target_modules=all-linear`` with ``tuning.lora_dropout=0`` reaches the experts where peft maps
them itself (peft 0.21.2: Qwen3-MoE, Mixtral, OLMoE; not Qwen2-MoE, GraniteMoE, GPT-OSS).
"""


@dataclass(frozen=True)
class FamilyFacts:
    model_type: str
    lora_targets: tuple[str, ...] | str = "all-linear"
    """peft ``target_modules``: module-name suffixes, ``"all-linear"``, or ``"attention"`` (the linear layers
    inside attention modules, found in the model: :data:`MOE_LORA_TARGETS`)."""
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
    _f("mixtral", sliding_window=True),
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
    # mixture-of-experts families: LoRA targets from the MoE rule (MOE_LORA_TARGETS)
    _f("qwen2_moe", sliding_window=True),
    _f("qwen3_moe", sliding_window=True),
    _f("olmoe"),
    _f("granitemoe"),
    _f("gpt_oss", attn_implementations=("eager",), sliding_window=True,
       notes="no SDPA (attention sinks); sliding layers alternate with full ones"),
]}

DEFAULT_FACTS = FamilyFacts(model_type="default")


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def num_experts(config) -> int:
    """Routed experts per mixture-of-experts layer, from the config; 0 for a dense decoder.

    The router of an MoE stays frozen under every tuning method: the objectives here have no
    load-balancing loss, so a router left to train is free to collapse onto a few experts.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _EXPERT_COUNTS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def facts_for(config_or_model) -> FamilyFacts:
    """Facts for a config, a model, or a model_type string; unknown families get the defaults.

    A mixture-of-experts config whose entry names no LoRA targets gets :data:`MOE_LORA_TARGETS`
    (a bare model_type string cannot say whether it is one).
    """
    config = None
    if isinstance(config_or_model, str):
        model_type = config_or_model
    else:
        config = getattr(config_or_model, "config", config_or_model)
        model_type = getattr(config, "model_type", "")
    facts = REGISTRY.get(model_type) or dataclasses.replace(DEFAULT_FACTS, model_type=model_type or "unknown")
    if config is not None and facts.lora_targets == "all-linear" and num_experts(config):
        facts = dataclasses.replace(facts, lora_targets=MOE_LORA_TARGETS)
    return facts


def preferred_attention(config_or_model) -> str:
    """The attention implementation under which this family honours ``is_causal=False``."""
    return facts_for(config_or_model).attn_implementations[0]


# What some causal LMs do to the head's output before returning logits (config attribute -> how): a
# scalar is folded into the weights of a sparse export's Dense head; a non-linear cap cannot be.
_LOGIT_DIVISORS = ("logits_scaling",)  # Granite, GraniteMoE: logits / logits_scaling
_LOGIT_MULTIPLIERS = ("logit_scale",)  # Cohere: logits * logit_scale
_LOGIT_CAPS = ("final_logit_softcapping",)  # Gemma 2, Gemma 3: cap * tanh(logits / cap)


def head_logit_scale(config) -> float | None:
    """The scalar this family's causal LM multiplies its LM head's output by (1.0 for most), or None when the
    logits then go through a non-linear function (a soft cap) that no linear head can reproduce."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(config, key, None) for key in _LOGIT_CAPS):
        return None
    scale = 1.0
    for key in _LOGIT_DIVISORS:
        scale /= float(getattr(config, key, None) or 1.0)
    for key in _LOGIT_MULTIPLIERS:
        value = getattr(config, key, None)
        scale *= float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0
    return scale

"""Tiny random decoders of many families and a tiny byte-level BPE tokenizer, all built offline.

``TINY_CONFIGS`` maps a transformers ``model_type`` to the keyword arguments of a very small config
of that family. Tests parametrize over it; adding a family is one entry here plus its facts in
``adapt.model.families``.
"""
from __future__ import annotations

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128)

_MOE = dict(_COMMON, num_experts_per_tok=2)  # 4 experts, top-2

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON),
    "mistral": dict(_COMMON, sliding_window=4),
    "qwen2": dict(_COMMON),
    "qwen3": dict(_COMMON, head_dim=8),
    "gemma": dict(_COMMON, head_dim=8),
    "gemma2": dict(_COMMON, head_dim=8, sliding_window=4),
    "gemma3_text": dict(_COMMON, head_dim=8, sliding_window=4, sliding_window_pattern=2),
    "phi3": dict(_COMMON),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=128),
    "olmo": dict(_COMMON),
    "olmo2": dict(_COMMON),
    "granite": dict(_COMMON),
    "stablelm": dict(_COMMON),
    "starcoder2": dict(_COMMON, sliding_window=None),
    "smollm3": dict(_COMMON),
    "phi": dict(_COMMON),
    # mixture-of-experts decoders (each config's own name for its expert count)
    "qwen3_moe": dict(_MOE, num_experts=4, moe_intermediate_size=64, head_dim=8),
    "qwen2_moe": dict(_MOE, num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=64),
    "mixtral": dict(_MOE, num_local_experts=4),
    "olmoe": dict(_MOE, num_experts=4),
    "granitemoe": dict(_MOE, num_local_experts=4),
    "gpt_oss": dict(_MOE, num_local_experts=4, head_dim=8, sliding_window=4),
}

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A decoder reads text from left to right. "
    "An encoder reads the whole sentence at once. Masked language modeling hides some tokens "
    "and asks the model to predict them. Retrieval systems embed queries and documents. "
    "Classification assigns a label to each text. Similarity compares two texts. "
) * 4


@functools.lru_cache(maxsize=None)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (about 320 tokens) with pad/bos/eos/unk and, on purpose, no mask token."""
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_config(family: str, vocab_size: int = 320, **overrides):
    # special ids match tiny_tokenizer(): <pad>=0, <s>=1, </s>=2
    kwargs = dict(TINY_CONFIGS[family], vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return AutoConfig.for_model(family, **kwargs)


def tiny_decoder(family: str = "llama", vocab_size: int = 320, seed: int = 0, **overrides):
    """A randomly initialised causal LM of ``family``, small enough to run a step in milliseconds."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, vocab_size, **overrides)).eval()

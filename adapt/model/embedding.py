"""Pooled embeddings of a causal LM while it trains: the module contrastive objectives run.

:class:`Embedder` pools the backbone's last hidden states exactly as the exported encoder will
(:mod:`adapt.model.pooling`), :func:`tokenize` pads as the encoder does, :func:`set_dropout` turns on the
dropout that decoders usually ship at 0 (SimCSE's two views need it).
"""
from __future__ import annotations

import torch

from adapt.model.families import facts_for
from adapt.model.bidirectional import position_ids_from_mask
from adapt.model.pooling import pool, pooling_name


def backbone_of(model):
    """The transformers base model (no LM head) inside a causal LM, possibly peft-wrapped."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model.base_model


class Embedder(torch.nn.Module):
    """``(input_ids, attention_mask) -> (B, H)`` fp32 pooled embeddings, as the exported encoder computes them.

    Holds the causal LM (or its peft wrapper) so that Accelerate/DDP wrap one module; the LM head is
    never run.
    """

    def __init__(self, model, pooling: str = "mean"):
        super().__init__()

        self.model = model
        self.pooling = pooling_name(pooling)
        self.absolute = facts_for(backbone_of(model).config).absolute_positions

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                prompt_length: torch.Tensor | None = None) -> torch.Tensor:
        """``prompt_length`` (B,): each row's leading tokens left out of pooling (a sink prompt and its prompt)."""
        kwargs = {"position_ids": position_ids_from_mask(attention_mask)} if self.absolute else {}
        hidden = backbone_of(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                         **kwargs).last_hidden_state  # (B, T, H)
        return pool(hidden.float(), attention_mask, self.pooling, 0 if prompt_length is None else prompt_length)


def tokenize(tokenizer, texts: list[str], max_length: int, device=None) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` as ``adapt.inference.encoder`` and sentence-transformers tokenize."""
    rows = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_length,
                     return_attention_mask=False, verbose=False)["input_ids"]
    pad = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    filler = next(i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id, pad) if i is not None)
    rows = [row or [filler] for row in rows]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


_DROPOUT_ATTRS = ("attention_dropout", "attn_dropout", "dropout", "hidden_dropout", "resid_dropout")


def set_dropout(model, p: float) -> int:
    """Set every dropout of a transformers model to ``p`` (``nn.Dropout`` modules and the float
    ``attention_dropout``-like attributes attention modules read in train mode); returns how many.

    Call it before LoRA is attached: LoRA's own dropout is ``tuning.lora_dropout``.
    """
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p, n = p, n + 1
            continue
        for name in _DROPOUT_ATTRS:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, p)
                n += 1
    return n



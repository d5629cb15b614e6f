"""Pooling token states into one vector, as sentence-transformers' ``Pooling`` module does.

Shared by training (the contrastive objectives pool as the exported encoder will), the fast encoder
and the export, so the three can never disagree.
"""
from __future__ import annotations

import torch

from adapt.errors import ConfigError

# adapt's pooling names -> sentence-transformers' pooling_mode (and back, with aliases).
POOLINGS = {"mean": "mean", "weightedmean": "weightedmean", "last": "lasttoken", "cls": "cls"}
_ALIASES = {"weighted_mean": "weightedmean", "weighted-mean": "weightedmean", "lasttoken": "last",
            "last_token": "last", "last-token": "last", "first": "cls", "first_token": "cls"}


def pooling_name(pooling: str) -> str:
    """adapt's canonical pooling name for ``pooling`` (also accepts sentence-transformers' mode names)."""
    name = _ALIASES.get(str(pooling).lower(), str(pooling).lower())
    if name not in POOLINGS:
        raise ConfigError(f"unknown pooling {pooling!r}: choose one of {', '.join(POOLINGS)}")
    return name


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str, prompt_length: int = 0) -> torch.Tensor:
    """Pool right-padded ``hidden`` (B, T, H) under ``mask`` (B, T) as sentence-transformers' Pooling does.

    ``weightedmean`` weighs position ``t`` by ``t + 1`` (later tokens, which have seen more of the text
    in a causal model, count more); ``last`` takes the last real token; ``cls`` the first.
    """
    if prompt_length:
        mask = mask.clone()
        mask[:, :prompt_length] = 0
    m = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    if pooling == "mean":
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    if pooling == "weightedmean":
        w = m * torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype).view(1, -1, 1)
        return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)
    if pooling == "last":
        values, indices = mask.flip(1).max(1)
        last = hidden.shape[1] - 1 - torch.where(values == 0, hidden.shape[1] - 1, indices)
        return (hidden * m)[torch.arange(hidden.shape[0]), last]
    if pooling == "cls":
        return hidden[torch.arange(hidden.shape[0]), mask.to(torch.int).argmax(1)]
    raise ConfigError(f"unknown pooling {pooling!r}: choose one of {', '.join(POOLINGS)}")

"""SPLADE vectors from a causal LM's vocabulary logits: what training, the sparse export and its checks share.

A text's vector has one weight per vocabulary term: ``w_j = max_t log(1 + relu(logit_tj))`` over its real
tokens (SPLADE v2's max pooling), exactly what sentence-transformers' ``SpladePooling("max", "relu")``
computes on the same logits. log1p and relu are monotone, so the max is taken over the raw logits first
and only the (B, V) result goes to fp32 (no (B, T, V) fp32 copy). The FLOPS regularizer (Paria et al.,
2020) is the squared mean weight of each term over the batch, summed: it pushes rarely useful terms to 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adapt.arch import facts_for
from adapt.bidirectional import position_ids_from_mask


def splade_pool(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits under a (B, T) mask -> (B, V) fp32 term weights, max over real tokens of log1p(relu)."""
    pad = ~attention_mask.bool().unsqueeze(-1)  # (B, T, 1)
    top = logits.masked_fill(pad, float("-inf")).amax(dim=1)  # (B, V)
    return top.float().relu().log1p()


def flops(weights: torch.Tensor) -> torch.Tensor:
    """FLOPS regularizer of a batch of term weights (N, V): sum over terms of the squared mean weight."""
    return weights.abs().mean(dim=0).pow(2).sum()


def regularizer_scale(step: int, warmup_steps: int) -> float:
    """SPLADE v2's quadratic warm-up of the FLOPS weights: (step / warmup)^2 until ``warmup_steps``, then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step / warmup_steps) ** 2)


def ranking_loss(queries: torch.Tensor, docs: torch.Tensor, targets: torch.Tensor,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of each query's positive among candidate ``docs`` scored by dot product (SPLADE has no
    temperature: the weights set their own scale). ``mask`` (Q, D) True drops a candidate. Returns (loss,
    number of queries whose positive scores highest)."""
    scores = queries @ docs.T  # (Q, D)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return F.cross_entropy(scores, targets), (scores.detach().argmax(dim=-1) == targets).sum()


def active_terms(weights: torch.Tensor) -> torch.Tensor:
    """Number of non-zero weights of each vector: (N, V) -> (N,)."""
    return (weights > 0).sum(dim=-1)


def keep_top_k(weights: torch.Tensor, k: int | None) -> torch.Tensor:
    """``weights`` (N, V) with all but each row's ``k`` largest set to 0 (``None``: unchanged)."""
    if not k or k >= weights.shape[-1]:
        return weights
    values, indices = weights.topk(k, dim=-1)
    return torch.zeros_like(weights).scatter(-1, indices, values)


class SparseLM(torch.nn.Module):
    """``(input_ids, attention_mask) -> (B, V)`` SPLADE weights of a causal LM (or its peft wrapper), computed as
    the exported sparse encoder computes them. Holds the model so Accelerate/DDP wrap one module."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
        self.absolute = facts_for(config).absolute_positions

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kwargs = {"position_ids": position_ids_from_mask(attention_mask)} if self.absolute else {}
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
        return splade_pool(logits, attention_mask)

"""Masked-LM labels and loss: MLM, MNTP and CLM batches, and the loss at labelled positions only.

One convention serves all three objectives: a label sits at the position whose hidden state
predicts it, ``-100`` elsewhere.

- MLM: masked position ``i`` is labelled with the original token ``i`` (predicted from ``i``).
- MNTP (masked next-token prediction, LLM2Vec): token ``i`` is masked and its label sits at
  ``i - 1``, so the decoder keeps predicting "the next token" from the previous position.
- CLM: no masking; the label at ``i`` is token ``i + 1``, and the forward runs with causal attention.

So a single :class:`LabeledPositionsLM` computes every loss: it runs the decoder, applies the LM
head only at labelled positions (a few hundred rows instead of B*T rows of a large vocabulary) and
takes the mean cross-entropy there in fp32.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn.functional as F

from adapt.errors import ConfigError
from adapt.config.schedule import check_objective

IGNORE_INDEX = -100
REPLACEMENTS = ("80-10-10", "mask")


# ----------------------------------------------------------------------------------------- masking

def _choose_exact(candidates: torch.Tensor, ratio: float, generator) -> torch.Tensor:
    """Mask exactly ``round(ratio * n)`` of the ``n`` candidates of each row (at least one if n > 0).

    Exact counts (not Bernoulli draws) keep the number of labels per row fixed, so no batch ends up
    with a loss over almost nothing. Returns a bool tensor shaped like ``candidates`` (B, T).
    """
    device = generator.device if generator is not None else candidates.device
    n = candidates.sum(dim=1)  # (B,)
    k = torch.where(n > 0, (n.float() * ratio).round().long().clamp(min=1), n)  # (B,)
    scores = torch.rand(candidates.shape, generator=generator, device=device).to(candidates.device)
    scores = scores.masked_fill(~candidates, 2.0)  # non-candidates sort last
    rank = scores.argsort(dim=1).argsort(dim=1)  # (B, T): 0 = smallest score
    return rank < k[:, None]


def mask_batch(input_ids: torch.Tensor, objective: str, *, mask_token_id: int | None, vocab_size: int,
               special_ids: Sequence[int] = (), ratio: float = 0.3, replacement: str = "80-10-10",
               generator: torch.Generator | None = None,
               attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Model inputs and aligned labels for one batch of ``objective``; both (B, T) long.

    Masking picks exactly ``round(ratio * n)`` of a row's ``n`` maskable tokens (not special, not
    padding; for MNTP also not position 0, whose label would fall off the left edge). With
    ``replacement="80-10-10"`` a masked input becomes the mask token with probability 0.8, a random
    non-special token with 0.1 and stays unchanged with 0.1 (drawn per token); with ``"mask"`` it is
    always the mask token. ``vocab_size`` bounds the random tokens (pass the tokenizer's length).
    CLM leaves the inputs unchanged and labels each real position with the next real token.
    """
    check_objective(objective)
    if not (isinstance(ratio, (int, float)) and 0 < ratio < 1):
        raise ConfigError(f"mask ratio must be in (0, 1), not {ratio!r}.")
    if replacement not in REPLACEMENTS:
        raise ConfigError(f"unknown mask replacement {replacement!r}; choose one of {', '.join(REPLACEMENTS)}.")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
    real = (attention_mask.bool() if attention_mask is not None
            else torch.ones_like(input_ids, dtype=torch.bool))  # (B, T): not padding
    labels = torch.full_like(input_ids, IGNORE_INDEX)

    if objective == "clm":
        valid = real[:, :-1] & real[:, 1:]  # (B, T-1): both the predicting and the predicted token are real
        labels[:, :-1] = torch.where(valid, input_ids[:, 1:], IGNORE_INDEX)
        return input_ids.clone(), labels

    if mask_token_id is None:
        raise ConfigError(f"objective {objective!r} needs a mask token; the tokenizer has none.")
    specials = torch.tensor(sorted(set(special_ids)), dtype=input_ids.dtype, device=input_ids.device)
    candidates = real & ~torch.isin(input_ids, specials)  # (B, T)
    if objective == "mntp":
        candidates[:, 0] = False
        candidates[:, 1:] &= real[:, :-1]  # the label goes to position i-1, which must be a real token
    masked = _choose_exact(candidates, ratio, generator)  # (B, T)

    if objective == "mlm":
        labels[masked] = input_ids[masked]
    else:  # mntp: the label of masked token i sits at i-1
        labels[:, :-1] = torch.where(masked[:, 1:], input_ids[:, 1:], IGNORE_INDEX)

    inputs = input_ids.clone()
    if replacement == "mask":
        inputs[masked] = mask_token_id
        return inputs, labels
    device = generator.device if generator is not None else input_ids.device
    u = torch.rand(input_ids.shape, generator=generator, device=device).to(input_ids.device)
    to_mask = masked & (u < 0.8)
    to_random = masked & (u >= 0.8) & (u < 0.9)  # the remaining 10% stay unchanged
    inputs[to_mask] = mask_token_id
    pool = torch.arange(vocab_size, device=input_ids.device)
    pool = pool[~torch.isin(pool, torch.cat([specials, specials.new_tensor([mask_token_id])]))]
    draws = torch.randint(len(pool), (int(to_random.sum()),), generator=generator, device=device)
    inputs[to_random] = pool[draws.to(pool.device)]
    return inputs, labels


# -------------------------------------------------------------------------------------------- loss

class LabeledPositionsLM(torch.nn.Module):
    """A causal LM (transformers, or peft around one) whose forward returns the loss at labelled positions.

    The trainer hands this wrapper to ``accelerator.prepare``, so DDP/FSDP wrap it and all compute
    happens inside :meth:`forward`. The decoder runs as usual, but a forward pre-hook on its output
    embeddings keeps only the labelled rows of the hidden states, ``(B, T, H) -> (1, N, H)``: the LM
    head then runs on N rows, and whatever the family's own ``*ForCausalLM.forward`` does around the
    head (Gemma2/3 final-logit soft-capping, Granite ``logits_scaling``, Cohere ``logit_scale``,
    MiniCPM hidden scaling, ...) is applied by the family's own code, not re-implemented here. A
    model that computes logits without calling its output-embeddings module falls back to full
    logits gathered at the labelled positions, which is slower and equally correct.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    @property
    def causal_lm(self) -> torch.nn.Module:
        """The ``*ForCausalLM`` itself (inside a peft wrapper, with its adapters injected)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                causal: bool = False, position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Mean fp32 cross-entropy over positions whose label is not -100, plus label/correct counts.

        ``causal=True`` (CLM batches) runs under ``adapt.model.bidirectional.causal_attention``. A batch
        without labels gives loss 0 that still belongs to the graph (backward works, grads are 0).
        """
        lm = self.causal_lm
        head = lm.get_output_embeddings()
        if head is None:
            raise TypeError(f"{type(lm).__name__} has no output embeddings (LM head); adapt needs a *ForCausalLM.")
        selected = labels != IGNORE_INDEX  # (B, T)
        gathered = []

        def only_labeled(module, args):
            hidden = args[0] if args else None
            if torch.is_tensor(hidden) and hidden.dim() == 3 and hidden.shape[:2] == selected.shape and not gathered:
                gathered.append(True)
                return (hidden[selected.to(hidden.device)].unsqueeze(0),) + tuple(args[1:])  # (1, N, H)
            return None

        handle = head.register_forward_pre_hook(only_labeled)
        if causal:
            from adapt.model.bidirectional import causal_attention

            attention = causal_attention(self.model)
        else:
            attention = contextlib.nullcontext()
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        try:
            with attention:
                logits = lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
        finally:
            handle.remove()
        if not gathered:
            logits = logits[selected.to(logits.device)]  # (B, T, V) -> (N, V)
        logits = logits.reshape(-1, logits.shape[-1]).float()  # (N, V), fp32 for a stable softmax
        targets = labels[selected].to(logits.device)  # (N,)
        n = targets.numel()
        loss = F.cross_entropy(logits, targets, reduction="sum") / max(n, 1)
        with torch.no_grad():
            correct = (logits.argmax(dim=-1) == targets).sum()
        return {"loss": loss, "n_labels": torch.tensor(n, device=logits.device), "n_correct": correct}

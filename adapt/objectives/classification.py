"""Sequence and token classification: cross-entropy on labeled texts, evaluated by accuracy and macro-F1.

Not a ``convert --stages`` kind (no ``KINDS``): :func:`adapt.pipeline.finetune.finetune` builds it directly
and runs it in the one loop (:class:`adapt.training.loop.Trainer`). The model is a transformers
``*ForSequenceClassification`` (maybe peft-wrapped). ``pooling="last"`` runs the class itself (the
last non-pad token, what a saved folder serves); ``pooling="mean"`` mean-pools the backbone's states
through the same ``score`` layer.

Batches: the training examples in the order of :func:`adapt.data.batches.batch_iterator` (epoch ``e`` is
a permutation seeded by ``(seed, e)``, the last batch of an epoch may be short), so optimizer step k
is a pure function of (seed, k, rank) and ``steps_per_epoch`` steps are one pass over the data.

Token classification (a ``*ForTokenClassification`` model): a label row per text, one id per token and
:data:`IGNORE` where a token is not scored (a word's later sub-tokens, special tokens, padding); accuracy
and macro-F1 then count the scored tokens.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from adapt.data.batches import batch_iterator
from adapt.errors import ConfigError
from adapt.objectives import ObjectiveBase, StepOutput

POOLINGS = ("last", "mean")
IGNORE = -100  # a token with no label (cross-entropy's ignore_index)


def pad_labels(rows: list[list[int]], width: int) -> torch.Tensor:
    """Token label rows right-padded with :data:`IGNORE` to ``width``: (B, width)."""
    out = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row[:width])
    return out


def pad_batch(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask)``, both (B, T), of token-id rows (none empty)."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return ids, mask


def unwrap_peft(model):
    """The transformers model inside a peft wrapper (LoRA layers in place), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def score_layer(model):
    """The decoder classification head ``score`` (under LoRA, peft's wrapper that runs the trainable copy)."""
    score = getattr(unwrap_peft(model), "score", None)
    if score is None:
        raise ConfigError(f"mean pooling needs a decoder classification head ('score'); "
                          f"{type(model).__name__} has none: use pooling='last'")
    return score


class ClassifierModule(torch.nn.Module):
    """What the loop trains: ``(input_ids, attention_mask, labels?) -> {"logits", "loss"}``.

    Holds the classifier as ``.model`` so that Accelerate wraps one module; ``loss`` is None without labels.
    """

    def __init__(self, model, pooling: str = "last"):
        super().__init__()
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling must be 'last' or 'mean', not {pooling!r}")
        self.model, self.pooling = model, pooling
        if pooling == "mean":
            score_layer(model)  # fail now, not at the first step

    def forward(self, input_ids, attention_mask, labels=None) -> dict:
        if self.pooling == "last":
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        else:
            inner = unwrap_peft(self.model)
            hidden = inner.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B, H)
            logits = score_layer(inner)(mean)
        if labels is None:
            loss = None
        elif logits.dim() == 3:  # token classification: (B, T, C) against (B, T) with IGNORE
            loss = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE)
        else:
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        return {"logits": logits, "loss": loss}


def scores_from_confusion(confusion: np.ndarray) -> dict:
    """Accuracy and macro-F1 from a (true, predicted) count matrix; like scikit-learn, the macro average
    runs over the labels that occur as truth or prediction, and a label never predicted scores 0."""
    confusion = np.asarray(confusion, dtype=np.float64)
    total = confusion.sum()
    tp = np.diag(confusion)
    support, predicted = confusion.sum(1), confusion.sum(0)
    present = (support + predicted) > 0
    f1 = 2 * tp[present] / (support[present] + predicted[present])
    return {"accuracy": float(tp.sum() / total) if total else 0.0,
            "macro_f1": float(f1.mean()) if present.any() else 0.0}


class Classification(ObjectiveBase):
    """Cross-entropy on ``train`` (token-id rows, label ids; for token classification a label row per
    text), accuracy and macro-F1 on ``dev``."""

    kind = "classification"
    loss_name = "cross-entropy"
    micro_batches = 1

    def __init__(self, train: tuple[list[list[int]], list[int]], dev: tuple[list[list[int]], list[int]], *,
                 num_labels: int, pad_id: int, batch_size: int, seed: int = 0, pooling: str = "last",
                 eval_batch_size: int = 64):
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling must be 'last' or 'mean', not {pooling!r}")
        self.train_ids, self.train_labels = train
        self.dev_ids, self.dev_labels = dev
        self.num_labels, self.pad_id, self.pooling = num_labels, pad_id, pooling
        self.batch_size, self.seed, self.eval_batch_size = batch_size, seed, eval_batch_size
        self.tokens = bool(self.train_labels) and isinstance(self.train_labels[0], (list, tuple))
        if self.tokens and pooling != "last":
            raise ConfigError("token classification labels every token: it takes no pooling (leave pooling='last')")

    def _labels(self, labels: list, width: int) -> torch.Tensor:
        return pad_labels(labels, width) if self.tokens else torch.tensor(labels)

    def steps_per_epoch(self, world_size: int = 1) -> int:
        """Optimizer steps of one pass over the training examples (the last batch may be short)."""
        return math.ceil(len(self.train_ids) / (self.batch_size * world_size))

    def module(self, model) -> torch.nn.Module:
        return ClassifierModule(model, self.pooling)

    def start(self, step: int, accelerator) -> None:
        self._batches = batch_iterator(np.arange(len(self.train_ids)), self.batch_size, seed=self.seed,
                                       start_step=step, drop_last=False, rank=accelerator.process_index,
                                       world_size=accelerator.num_processes)

    def step(self, module, accelerator, step: int) -> StepOutput:
        rows = next(self._batches)
        weight = 1.0
        if not len(rows):  # a short last batch left this process nothing: run one row that counts for nothing
            rows, weight = np.arange(1), 0.0
        x, m = pad_batch([self.train_ids[i] for i in rows], self.pad_id)
        y = self._labels([self.train_labels[i] for i in rows], x.shape[1])
        loss = module(x.to(accelerator.device), m.to(accelerator.device), y.to(accelerator.device))["loss"] * weight
        accelerator.backward(loss)
        return StepOutput(loss.detach(), int(m.sum()) * accelerator.num_processes, "classification")

    @torch.no_grad()
    def evaluate(self, module, accelerator) -> dict:
        """``eval/accuracy`` and ``eval/macro_f1`` on the dev examples: each process predicts its slice of
        every batch (all run as many forwards), and the confusion counts are gathered and summed."""
        acc = accelerator
        rank, world = acc.process_index, acc.num_processes
        confusion = torch.zeros((self.num_labels, self.num_labels), dtype=torch.float64)
        was_training = module.training
        module.eval()
        for start in range(0, len(self.dev_ids), self.eval_batch_size):
            rows = np.array_split(np.arange(start, min(start + self.eval_batch_size, len(self.dev_ids))), world)[rank]
            counted = len(rows) > 0
            rows = rows if counted else np.array([start])
            x, m = pad_batch([self.dev_ids[i] for i in rows], self.pad_id)
            predicted = module(x.to(acc.device), m.to(acc.device))["logits"].argmax(-1).cpu()
            if counted:
                truth = self._labels([self.dev_labels[i] for i in rows], x.shape[1])
                if self.tokens:  # the scored tokens only
                    scored = truth != IGNORE
                    truth, predicted = truth[scored], predicted[scored]
                confusion.index_put_((truth, predicted), torch.ones(len(truth), dtype=torch.float64), accumulate=True)
        module.train(was_training)
        total = acc.gather_for_metrics(confusion.to(acc.device).unsqueeze(0)).sum(0).cpu().numpy()
        return {f"eval/{k}": v for k, v in scores_from_confusion(total).items()}

    def summary(self) -> dict:
        return {"pooling": self.pooling, "labels": self.num_labels, "train_examples": len(self.train_ids),
                "dev_examples": len(self.dev_ids)}

"""Train a sequence, pair or token classifier in memory and predict with it: what ``adapt finetune`` saves
and what ``adapt bench --suite finetune`` scores.

Three kinds of labeled examples, one code path:

- ``sequence``: a text and its label;
- ``pair``: two texts and their label (paraphrase, entailment); encoded as the tokenizer's pair when it has a
  separator token (BERT: ``[CLS] a [SEP] b [SEP]``), else ``a`` + EOS + ``b`` (a decoder's tokenizer joins a
  pair with nothing between);
- ``token``: a sentence as words with one tag a word; each word is tokenized on its own (with the space
  before it) and its first sub-token carries the tag, the others :data:`IGNORE` (as transformers' token
  classification examples do), so the words' sub-tokens are exactly the sentence's.

:func:`fit_classifier` loads the head (:func:`adapt.model.loading.load_sequence_classifier`), applies full or
LoRA tuning (the new head trained in full), runs :class:`adapt.objectives.classification.Classification` in
the one loop (:class:`adapt.training.loop.Trainer`) for ``epochs`` passes - early stopping on dev macro-F1
when there is a dev split - and returns the merged model in eval mode.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from adapt.config.run_folder import CHECKPOINTS
from adapt.config.settings import TrainConfig, TuningConfig
from adapt.errors import ConfigError
from adapt.files import read_jsonl
from adapt.model.loading import load_sequence_classifier
from adapt.model.tuning import apply_tuning, merged_model
from adapt.objectives.classification import IGNORE, Classification, pad_batch
from adapt.training.loop import Trainer, build_accelerator

KINDS = ("sequence", "pair", "token")
HEAD_NAMES = ("score", "classifier")  # the new head of decoder classes (score) and of BERT-like ones (classifier)


def head_of(kind: str) -> str:
    """The transformers head a kind of example trains: ``"token"`` or ``"sequence"``."""
    if kind not in KINDS:
        raise ConfigError(f"the kind of examples must be one of {', '.join(KINDS)}, not {kind!r}")
    return "token" if kind == "token" else "sequence"


def _filler(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id]


def encode_texts(tokenizer, texts: list, max_length: int) -> list[list[int]]:
    """Token ids of texts (``str``) or pairs (``(a, b)``); an empty text becomes a lone EOS token."""
    if not texts or isinstance(texts[0], str):
        return [row or _filler(tokenizer) for row in tokenizer(list(texts), truncation=True,
                                                                 max_length=max_length)["input_ids"]]
    firsts, seconds = [a for a, _ in texts], [b for _, b in texts]
    if tokenizer.sep_token_id is not None:  # the tokenizer's own pair format
        rows = tokenizer(firsts, seconds, truncation="longest_first", max_length=max_length)["input_ids"]
        return [row or _filler(tokenizer) for row in rows]
    joint = _filler(tokenizer)
    out = []
    for a, b in zip(tokenizer(firsts)["input_ids"], tokenizer(seconds, add_special_tokens=False)["input_ids"]):
        room = max(max_length - len(joint), 2)
        keep_b = min(len(b), room // 2) if len(a) > room // 2 else min(len(b), room - len(a))
        out.append((a[:room - keep_b] + joint + b[:keep_b])[:max_length])
    return out


def encode_words(tokenizer, sentences: list[list[str]], tags: list[list[int]] | None,
                 max_length: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ids rows, label rows): each word tokenized with the space before it, its first sub-token labeled
    with the word's tag id, the rest and special tokens :data:`IGNORE`; cut to ``max_length`` tokens.
    ``tags`` None: every word labeled 0 (the rows then mark which tokens start a word)."""
    ids_rows, label_rows = [], []
    for s, words in enumerate(sentences):
        ids, labels = [], []
        for w, word in enumerate(words):
            piece = tokenizer(word if w == 0 else " " + word, add_special_tokens=False)["input_ids"] or _filler(tokenizer)
            ids += piece
            labels += [tags[s][w] if tags is not None else 0] + [IGNORE] * (len(piece) - 1)
        full = tokenizer.build_inputs_with_special_tokens(ids) if hasattr(tokenizer, "build_inputs_with_special_tokens") else ids
        start = next((i for i in range(len(full) - len(ids) + 1) if full[i:i + len(ids)] == ids), None)
        if start is None:  # a tokenizer that rewrites the ids it wraps: no special tokens
            full, start = ids, 0
        labels = [IGNORE] * start + labels + [IGNORE] * (len(full) - start - len(ids))
        ids_rows.append((full or _filler(tokenizer))[:max_length])
        label_rows.append((labels or [IGNORE])[:max_length])
    return ids_rows, label_rows


@dataclass
class Fitted:
    """A trained classifier (merged, eval mode, on the CPU) with its tokenizer and what its training logged."""

    model: torch.nn.Module
    tokenizer: object
    labels: list[str]
    history: list[dict] = field(default_factory=list)
    best_epoch: int | None = None
    epochs_run: int = 0
    dev: dict = field(default_factory=dict)


def encode(tokenizer, kind: str, examples: list, labels: list | None, label2id: dict, max_length: int):
    """(ids rows, label ids or label rows) of ``examples`` of ``kind`` (see the module docstring)."""
    if kind == "token":
        tags = None if labels is None else [[label2id[t] for t in row] for row in labels]
        return encode_words(tokenizer, examples, tags, max_length)
    return encode_texts(tokenizer, examples, max_length), None if labels is None else [label2id[y] for y in labels]


def fit_classifier(base_dir, kind: str, train: tuple[list, list], label_names: list[str], run_dir: Path, *,
                   dev: tuple[list, list] | None = None, tuning: str = "full", lr: float | None = None,
                   epochs: int = 3, batch_size: int = 16, max_length: int = 256, patience: int = 2, seed: int = 0,
                   lora_r: int = 16, pooling: str = "last", bidirectional: bool = True,
                   show_progress: bool = True) -> Fitted:
    """Train a ``kind`` classifier on ``train`` (examples, labels) from the backbone in ``base_dir``.

    With ``dev``: evaluated once an epoch, early stopping on dev macro-F1 after ``patience`` epochs without
    a better one, the best epoch's weights kept. Without: exactly ``epochs`` passes (a fixed budget).
    ``lr`` defaults to 2e-5 (full) or 2e-4 (LoRA), constant, no warmup. ``bidirectional=False`` keeps a
    decoder causal (the baseline of a decoder's own classification class). The loop's log is
    ``run_dir/metrics.jsonl``; ``run_dir`` is emptied first.
    """
    from accelerate.utils import set_seed
    import shutil

    head = head_of(kind)
    label2id = {name: i for i, name in enumerate(label_names)}
    base = TrainConfig(batch_size=batch_size, lr=(2e-5 if tuning == "full" else 2e-4) if lr is None else lr,
                       weight_decay=0.01, warmup_ratio=0.0, scheduler="constant", max_grad_norm=0.0, save_every=0,
                       keep_checkpoints=1, seed=seed, best_metric="eval/macro_f1" if dev else None,
                       patience=max(patience, 1))
    acc = build_accelerator(base, run_dir)
    if acc.is_main_process:
        shutil.rmtree(run_dir, ignore_errors=True)
    acc.wait_for_everyone()
    set_seed(seed)  # the new head's initialisation
    model, tokenizer = load_sequence_classifier(base_dir, label_names, head=head, bidirectional=bidirectional)
    train_ids, train_y = encode(tokenizer, kind, train[0], train[1], label2id, max_length)
    dev_ids, dev_y = encode(tokenizer, kind, dev[0], dev[1], label2id, max_length) if dev else ([], [])
    objective = Classification((train_ids, train_y), (dev_ids, dev_y), num_labels=len(label_names),
                               pad_id=tokenizer.pad_token_id, batch_size=batch_size, seed=seed, pooling=pooling)
    tuning_cfg = TuningConfig(method=tuning, lora_r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0)
    heads = [name for name in HEAD_NAMES if isinstance(getattr(model, name, None), torch.nn.Module)]
    model = apply_tuning(model, tuning_cfg, modules_to_save=heads)
    per_epoch = objective.steps_per_epoch(acc.num_processes)
    every = per_epoch if dev_ids else 0
    train_cfg = replace(base, max_steps=epochs * per_epoch, eval_every=every, log_every=per_epoch)
    trainer = Trainer(model, objective, train=train_cfg, run_dir=run_dir, accelerator=acc, show_progress=show_progress)
    result = trainer.fit()  # with dev: ends with the best epoch's weights in place
    model = merged_model(acc.unwrap_model(trainer.module).model, tuning_cfg).eval()
    if acc.is_main_process:
        shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)  # resume points of a run that is over
    history = _history(result.metrics_path, per_epoch)
    fitted = Fitted(model, tokenizer, list(label_names), history, epochs_run=result.step // per_epoch)
    if dev_ids and trainer.best:
        fitted.best_epoch = trainer.best["step"] // per_epoch
        fitted.dev = next((h for h in history if h["epoch"] == fitted.best_epoch), {})
    return fitted


def _history(metrics_path: Path, steps_per_epoch: int) -> list[dict]:
    """Per-epoch train loss and, where evaluated, dev figures from the loop's log (logged once an epoch)."""
    by_step: dict[int, dict] = {}
    for record in read_jsonl(metrics_path):
        by_step.setdefault(record["step"], {}).update(record)
    out = []
    for step, r in sorted(by_step.items()):
        if "loss" in r:
            out.append({"epoch": step // steps_per_epoch, "train_loss": r["loss"],
                        **({"accuracy": r["eval/accuracy"], "macro_f1": r["eval/macro_f1"]} if "eval/accuracy" in r else {})})
    return out


def batched_logits(model, ids: list[list[int]], pad_id: int, batch_size: int = 32):
    """``(rows, logits)`` a batch, in float32 on the CPU: ``ids`` run longest first (less padding), ``rows`` their
    indices in ``ids``. The model is put in eval mode and run without gradients."""
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            x, m = pad_batch([ids[i] for i in rows], pad_id)
            yield rows, model(input_ids=x.to(model.device), attention_mask=m.to(model.device)).logits.float().cpu()


def predict_ids(model, ids: list[list[int]], pad_id: int, *, batch_size: int = 32) -> list:
    """Predicted label ids: one a row (sequence head) or a list a row, one a token (token head)."""
    out: list = [None] * len(ids)
    for rows, logits in batched_logits(model, ids, pad_id, batch_size):
        for k, i in enumerate(rows):
            out[i] = logits[k, :len(ids[i])].argmax(-1).tolist() if logits.dim() == 3 else int(logits[k].argmax())
    return out


def predict(fitted: Fitted, kind: str, examples: list, *, max_length: int = 256, batch_size: int = 32) -> list:
    """Predicted label names: one an example, or (``token``) one a word (a word cut off by ``max_length``
    gets the first label, so that every word has a prediction to score)."""
    label2id = {name: i for i, name in enumerate(fitted.labels)}
    ids, starts = encode(fitted.tokenizer, kind, examples, None, label2id, max_length)
    pad = fitted.tokenizer.pad_token_id if fitted.tokenizer.pad_token_id is not None else 0
    got = predict_ids(fitted.model, ids, pad, batch_size=batch_size)
    if kind != "token":
        return [fitted.labels[i] for i in got]
    out = []
    for words, row, marks in zip(examples, got, starts):
        tags = [fitted.labels[p] for p, mark in zip(row, marks) if mark != IGNORE]
        out.append(tags + [fitted.labels[0]] * (len(words) - len(tags)))
    return out


def stratified_split(labels: list[str], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, dev) indices: ``fraction`` of each label in dev (at least one of a label with two or more)."""
    rng, train, dev = random.Random(seed), [], []
    for label in sorted(set(labels)):
        idx = [i for i, y in enumerate(labels) if y == label]
        rng.shuffle(idx)
        k = max(1, round(len(idx) * fraction)) if len(idx) > 1 else 0
        dev += idx[:k]
        train += idx[k:]
    return train, dev


def unique_labels(kind: str, *label_lists: list) -> list[str]:
    """The label names of all splits, sorted (their ids in that order)."""
    found = set()
    for labels in label_lists:
        for y in labels:
            found.update(map(str, y) if kind == "token" else [str(y)])
    return sorted(found)


def accuracy_and_f1(truth: list, predicted: list, labels: list[str]) -> dict:
    """Accuracy and macro-F1 (flattened over words for token rows)."""
    from adapt.objectives.classification import scores_from_confusion

    flat_t = [y for row in truth for y in row] if truth and isinstance(truth[0], (list, tuple)) else list(truth)
    flat_p = [y for row in predicted for y in row] if predicted and isinstance(predicted[0], (list, tuple)) else list(predicted)
    index = {name: i for i, name in enumerate(labels)}
    confusion = np.zeros((len(labels), len(labels)))
    for t, p in zip(flat_t, flat_p):
        confusion[index[t], index[p]] += 1
    return scores_from_confusion(confusion)

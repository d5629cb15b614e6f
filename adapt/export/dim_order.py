"""Dimensions in order of importance: ``export.order_dims: pca``.

An encoder's pooled vector spreads what it knows over all its dimensions, so its first N are no better
than any other N: ``truncate_dim`` (``adapt embed --dim``, ``adapt bench --dims``) then throws away as
much as it keeps. This turns the vector, at export, onto its principal axes: an orthogonal matrix ``Q``
whose rows are the eigenvectors of the second moment of the unit-length pooled vectors of the stage's
own training text, largest eigenvalue first. ``Q`` ships as a sentence-transformers ``Dense`` layer (no
bias, no activation) after the pooling, so every loader applies it with no custom code.

Because ``Q`` is orthogonal, the full-size vectors keep their lengths and their dot products and cosine
similarities exactly (up to float rounding): nothing changes at full size for retrieval, similarity or
clustering. A prefix of N dimensions is then the best N-dimensional linear summary of those vectors (in
the least-squares sense, on the fitting text). It complements Matryoshka training
(``contrastive.matryoshka_dims``) and needs no training. The second moment is taken uncentred: the
vectors are not shifted, so the common direction most of them share is kept as the first axis.
"""
from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from adapt.errors import ConfigError

log = logging.getLogger(__name__)

SPAN_WORDS = 32  # fitting texts: documents cut into spans of at most this many words (the crops' scale)


def principal_axes(vectors: np.ndarray) -> np.ndarray:
    """The orthogonal ``(d, d)`` matrix ``Q`` whose rows are the principal axes of ``vectors`` (n, d) made unit
    length, largest second moment first; each axis signed so its largest component is positive (the same
    vectors always give the same ``Q``). ``vectors @ Q.T`` are the vectors in that basis."""
    x = np.asarray(vectors, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ConfigError(f"ordering dimensions needs at least 2 vectors, not {x.shape[0] if x.ndim == 2 else x.shape}")
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    values, vectors_ = np.linalg.eigh(x.T @ x / len(x))  # ascending
    axes = vectors_[:, ::-1].T.copy()  # rows, largest first
    signs = np.sign(axes[np.arange(len(axes)), np.abs(axes).argmax(axis=1)])
    return axes * signs[:, None]


def fitting_texts(sources=(), *, pairs: str | None = None, text_field: str = "text", limit: int = 4096,
                  seed: int = 0) -> list[str]:
    """Up to ``limit`` texts to fit the axes on: the documents of ``sources`` (files, folders, ``gensim:``/``hf:``
    sources) cut into spans of at most 32 words, else the queries and positives of the ``pairs`` file; a
    seeded sample when there are more."""
    from adapt.data.token_store import resolve_data_sources
    from adapt.data.pairs import load_documents, load_pairs

    texts: list[str] = []
    if sources:
        documents, _ = load_documents(resolve_data_sources(list(sources)), text_field=text_field, min_words=1)
        for doc in documents:
            words = doc.split()
            texts += [" ".join(words[i:i + SPAN_WORDS]) for i in range(0, len(words), SPAN_WORDS)]
    elif pairs:
        for pair in load_pairs(pairs)[0]:
            texts += [pair.query, pair.positive]
    if len(texts) < 2:
        raise ConfigError("export.order_dims: pca fits the axes on text, and there is "
                          f"{'no text' if not texts else 'one text'} to fit on: give the stage data.sources (--data) or "
                          "contrastive.pairs (--pairs), or set export.order_dims: none")
    if len(texts) > limit:
        keep = np.random.default_rng(seed).choice(len(texts), size=limit, replace=False)
        texts = [texts[i] for i in sorted(keep)]
    return texts


def stage_texts(cfg) -> list[str]:
    """:func:`fitting_texts` of a stage's own training data (``RunConfig``)."""
    return fitting_texts(cfg.data.sources, pairs=cfg.contrastive.pairs, text_field=cfg.data.text_field,
                         limit=cfg.export.order_texts, seed=cfg.train.seed)


def fit_order(model, tokenizer, texts: list[str], *, pooling: str, max_length: int,
              prompt: str = "", sink_prompt: str = "") -> tuple[torch.Tensor, dict]:
    """The ``(H, H)`` rotation (``Dense`` weight) that puts ``model``'s pooled vectors in principal order,
    fitted on ``texts``, and what the manifest records of it. ``model``'s train/eval mode is kept. With a
    ``sink_prompt`` the texts are pooled as the export pools them: sink and prompt before, left out of pooling."""
    from adapt.inference.encoder import EncodeWarning, Encoder
    from adapt.export.dense import backbone_of
    from adapt.model.pooling import pooling_name

    backbone = backbone_of(model)
    was_training = backbone.training
    encoder = Encoder(backbone, tokenizer, name="order_dims", pooling=pooling_name(pooling), normalize=False,
                      max_length=int(max_length), include_prompt=not sink_prompt)
    try:
        with warnings.catch_warnings():  # spans cut at max_seq_length, as the encoder cuts them in use
            warnings.simplefilter("ignore", EncodeWarning)
            vectors = encoder.encode(texts, batch_size=32, prompt=sink_prompt + prompt)
    finally:
        backbone.train(was_training)
    axes = principal_axes(vectors)
    share = _leading_share(vectors, axes)
    log.info("order_dims: principal axes of %d texts; the first quarter of the axes holds %.0f%% of their "
             "second moment", len(texts), 100 * share)
    return torch.from_numpy(axes).float(), {"method": "pca", "texts": len(texts), "quarter_share": round(share, 4)}


def _leading_share(vectors: np.ndarray, axes: np.ndarray) -> float:
    """Fraction of the unit vectors' second moment on the first quarter of ``axes``."""
    x = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    energy = ((x @ axes.T) ** 2).mean(axis=0)
    return float(energy[: max(1, len(energy) // 4)].sum() / energy.sum())


def fitted_order(order_dims: str, data, model, tokenizer, settings: dict, runs_texts):
    """(rotation, record) for ``--order-dims``: "none" -> (None, None); "pca" -> fitted on the documents of
    ``data``, else on ``runs_texts()`` (a checkpoint's run data). ``settings``: the export's pooling,
    max_seq_length, prompts and sink_prompt."""
    if order_dims == "none":
        return None, None
    texts = fitting_texts(data) if data else runs_texts()
    return fit_order(model, tokenizer, texts, pooling=settings["pooling"], max_length=settings["max_seq_length"],
                     prompt=(settings["prompts"] or {}).get("document", ""), sink_prompt=settings["sink_prompt"])

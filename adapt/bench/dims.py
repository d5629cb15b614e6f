"""Scoring each model at several embedding sizes: ``adapt bench MODEL --dims 576,256,64``.

An encoder trained with Matryoshka sizes (``contrastive.matryoshka_dims``) serves its first N
dimensions as an embedding of its own. Each model is encoded once per task (through the embedding
cache, at full size); its vectors are then cut to each size (re-normalized when they came
normalized, as ``adapt embed --dim`` and sentence-transformers' ``truncate_dim`` with
``normalize_embeddings`` give them) and scored, each size as a row of its own: ``NAME@dim=256``.
``full`` is each model's own size. BM25 has no embedding and keeps one row under its name.
"""
from __future__ import annotations

import logging

import numpy as np

from adapt.bench.bm25 import BM25Baseline
from adapt.bench.sparse import SparseRetriever
from adapt.bench.cache import EmbeddingCache, embed, texts_hash
from adapt.errors import ConfigError

log = logging.getLogger(__name__)

FULL = "full"


class TooLarge(ConfigError):
    """A size above a model's own number of dimensions."""


def parse_dims(value) -> list:
    """``"576,256,64"``, ``[576, "full", 64]`` -> the sizes, in the given order; None or empty -> []."""
    if value is None:
        return []
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else list(value)
    out = []
    for item in items:
        text = str(item).strip().lower()
        if text == FULL:
            out.append(FULL)
        elif text.isdigit() and int(text) > 0 and not isinstance(item, (bool, float)):
            out.append(int(text))
        else:
            raise ConfigError(f"--dims: {item!r} is not a number of dimensions (a whole number above 0) or 'full'")
    if len(set(out)) != len(out):
        raise ConfigError(f"--dims lists a size twice: {','.join(map(str, out))}")
    return out


def label(name: str, dim) -> str:
    """The report name of model ``name`` at size ``dim`` (None: the model as it is)."""
    return name if dim is None else f"{name}@dim={dim}"


def sizes_of(encoder, dims: list) -> list:
    """The sizes a model is scored at: ``dims``, or ``[None]`` (as it is) without dims and for BM25 and sparse
    encoders (their vectors are vocabulary terms: no prefix to cut)."""
    return [None] if not dims or isinstance(encoder, (BM25Baseline, SparseRetriever)) else list(dims)


def truncate(vectors: np.ndarray, dim) -> np.ndarray:
    """The first ``dim`` columns of ``vectors`` (None or ``full``: all), re-normalized when every row came
    unit-length. :class:`TooLarge` when ``dim`` is more than the vectors have."""
    if dim in (None, FULL):
        return vectors
    if dim > vectors.shape[1]:
        raise TooLarge(f"--dims {dim}: the model has only {vectors.shape[1]} dimensions")
    norms = np.linalg.norm(vectors, axis=1)
    cut = np.ascontiguousarray(vectors[:, :dim])
    if len(norms) and np.allclose(norms, 1.0, atol=1e-3):
        cut = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut.astype(np.float32, copy=False)


class TaskVectors:
    """One model's embeddings of one task's texts, encoded once (through ``cache``), cut to any size."""

    def __init__(self, encoder, cache: EmbeddingCache, key: str, name: str, batch_size: int, procs=None,
                 siblings=()):
        self.encoder, self.cache, self.key, self.name, self.batch_size = encoder, cache, key, name, batch_size
        self.procs = procs  # several processes: each encodes its share (adapt.bench.cache.embed)
        self.siblings = siblings  # models pooled from the same forward (adapt.bench.cache.embed)
        self.full: dict[tuple, np.ndarray] = {}

    def at(self, dim):
        """``embed(texts, prompt)`` giving vectors of size ``dim`` (None: as the model gives them)."""
        def fn(texts: list[str], prompt: str | None) -> np.ndarray:
            k = (prompt, texts_hash(texts))
            if k not in self.full:
                self.full[k] = embed(self.encoder, texts, prompt=prompt, batch_size=self.batch_size,
                                     cache=self.cache, model_key=self.key, model_name=self.name, procs=self.procs,
                                     siblings=self.siblings)
            return truncate(self.full[k], dim)
        return fn


def too_large(error: TooLarge, name: str, required: bool) -> None:
    """A size above a model's own: an error for a model the user listed, else skipped with a warning
    (a baseline or reference of another size)."""
    if required:
        raise ConfigError(f"{name}: {error}") from None
    log.warning("%s: %s; that size is skipped for it", name, error)


def pairs_at(baselines_of: dict[str, list[str]], names: set[str], dims: list) -> dict[str, list[str]]:
    """``{model: [its baselines]}`` by display name -> the same by report name, size by size (a model at
    256 dimensions against its baselines at 256), over the names that were scored."""
    out = {}
    for model, others in baselines_of.items():
        for dim in dims or [None]:
            found = [label(o, dim) for o in others if label(o, dim) in names]
            if label(model, dim) in names and found:
                out[label(model, dim)] = found
    return out

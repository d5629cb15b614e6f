"""Embedding cache for benchmark runs, and the one place that calls an encoder.

Embeddings are stored as ``.npy`` files under ``OUT/cache/<model>/<key>.npy``, keyed by the model
(fingerprint, spec, max_length), the prompt name and a hash of the exact texts. A later run with one
more model therefore only encodes that model, and tasks over the same texts share embeddings.
Files are written to a temporary name and renamed, so an interrupted run leaves no torn file.

Under several processes (``torchrun`` / ``accelerate launch``, see :mod:`adapt.inference.shards`) each
process encodes its share of a text group's batches, the shares are gathered in input order, and only
process 0 reads and writes the cache (it tells the others what it found).
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import warnings
from pathlib import Path

import numpy as np

from adapt.inference.shards import Processes, gather
from adapt.errors import AdaptError


def texts_hash(texts: list[str]) -> str:
    h = hashlib.sha256()
    h.update(str(len(texts)).encode())
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class EmbeddingCache:
    """``get``/``put`` of float32 (n, d) arrays; ``root=None`` disables caching."""

    def __init__(self, root: str | os.PathLike | None):
        self.root = Path(root) if root is not None else None
        self.hits = 0
        self.misses = 0

    def path(self, model_key: str, model_name: str, prompt: str | None, texts: list[str]) -> Path | None:
        if self.root is None:
            return None
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)[:60].strip("_") or "model"
        model_dir = f"{slug}-{hashlib.sha256(model_key.encode()).hexdigest()[:12]}"
        key = hashlib.sha256(f"{prompt}|{texts_hash(texts)}".encode()).hexdigest()[:32]
        return self.root / model_dir / f"{key}.npy"

    def get(self, path: Path | None, n: int) -> np.ndarray | None:
        if path is None or not path.exists():
            return None
        try:
            emb = np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            return None  # a damaged file is recomputed and overwritten
        if emb.ndim != 2 or emb.shape[0] != n:
            return None
        return emb

    def put(self, path: Path | None, emb: np.ndarray) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, emb, allow_pickle=False)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def embed(encoder, texts: list[str], *, prompt: str | None, batch_size: int, cache: EmbeddingCache,
          model_key: str, model_name: str, procs: Processes | None = None, siblings=()) -> np.ndarray:
    """Embeddings of ``texts`` (float32, one row per text), from the cache or from ``encoder``.

    Texts are sorted longest first and cut into blocks of ``batch_size`` (similar lengths in a block:
    less padding), then put back in their order. Each block is one ``encode`` call, and under ``procs``
    of several processes process ``rank`` encodes the blocks ``k`` with ``k % world == rank``: the same
    calls on the same texts as in one process, so the vectors (and the scores) are the same bit for bit.
    Every process gets the whole array. ``prompt`` is passed only to encoders that declare it in a
    ``prompts`` mapping (sentence-transformers style); others embed the raw text.

    ``siblings``: ``(encoder, model_key, model_name)`` of models that differ from ``encoder`` only in pooling
    (:func:`adapt.inference.encoder.variant`s of its loaded model). In one process with an on-disk cache, the ones the cache
    lacks are pooled from the same forward (``encode_poolings``) and written to the cache, where their own turn
    finds them: the same vectors as their own pass would give, for one forward instead of several.
    """
    procs = procs or Processes()
    if not texts:
        raise AdaptError("nothing to embed: the task has no texts")
    path = cache.path(model_key, model_name, prompt, texts)
    cached = cache.get(path, len(texts)) if procs.main else None
    if procs.world > 1:  # process 0 alone reads the cache: one answer for all
        cached = gather(procs, cached)[0]
    if cached is not None:
        cache.hits += 1
        return cached
    cache.misses += 1
    share = []  # (sibling encoder, its cache path) to fill from this forward
    if procs.world == 1 and cache.root is not None and hasattr(encoder, "encode_poolings"):
        for other, key, name in siblings:
            other_path = cache.path(key, name, prompt, texts)
            if other.pooling != encoder.pooling and cache.get(other_path, len(texts)) is None:
                share.append((other, other_path))
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    blocks = [order[at:at + batch_size] for at in range(0, len(order), batch_size)]
    prompts = getattr(encoder, "prompts", None) or {}
    kwargs = {"prompt_name": prompt} if prompt and prompt in prompts else {}
    poolings = list(dict.fromkeys([encoder.pooling, *(other.pooling for other, _ in share)])) if share else None
    mine = []
    with warnings.catch_warnings():  # texts beyond max_length are cut on purpose in a benchmark
        warnings.filterwarnings("ignore", message=r".*were truncated")
        for block in blocks[procs.rank::procs.world]:
            block_texts = [texts[i] for i in block]
            if poolings:
                pooled = encoder.encode_poolings(block_texts, poolings, batch_size=batch_size, **kwargs)
                mine.append({p: np.asarray(v, dtype=np.float32) for p, v in pooled.items()})
            else:
                mine.append(np.asarray(encoder.encode(block_texts, batch_size=batch_size, show_progress=False,
                                                      **kwargs), dtype=np.float32))
    if poolings:
        for other, other_path in share:
            cache.put(other_path, _in_order([part[other.pooling] for part in mine], blocks, order, other.name,
                                            batch_size))
        mine = [part[encoder.pooling] for part in mine]
    shares = gather(procs, mine) if procs.world > 1 else [mine]
    parts = [shares[k % procs.world][k // procs.world] for k in range(len(blocks))]  # block k, in order
    emb = _in_order(parts, blocks, order, model_name, batch_size)
    if procs.main:
        cache.put(path, emb)
    return emb


def _in_order(parts: list[np.ndarray], blocks: list[list[int]], order: list[int], model_name: str,
              batch_size: int) -> np.ndarray:
    """The blocks' vectors put back in text order, after checking their shapes and values."""
    if any(part.ndim != 2 or part.shape[0] != len(block) for part, block in zip(parts, blocks)) or \
            len({part.shape[1] for part in parts}) > 1:
        shapes = sorted({part.shape for part in parts})
        raise AdaptError(f"{model_name}: encode returned shapes {shapes} for blocks of up to {batch_size} texts; "
                         "expected (texts, dim)")
    out = np.concatenate(parts)
    if not np.isfinite(out).all():
        raise AdaptError(f"{model_name}: encode returned NaN or infinite values; the model is broken "
                         "(try dtype=float32)")
    emb = np.empty_like(out)
    emb[np.asarray(order)] = out
    return emb

"""Embedding cache for benchmark runs, and the one place that calls an encoder.

Embeddings are stored as ``.npy`` files under ``OUT/cache/<model>/<key>.npy``, keyed by the model
(fingerprint, spec, max_length), the prompt name and a hash of the exact texts. A later run with one
more model therefore only encodes that model, and tasks over the same texts share embeddings.
Files are written to a temporary name and renamed, so an interrupted run leaves no torn file.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import warnings
from pathlib import Path

import numpy as np

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
          model_key: str, model_name: str) -> np.ndarray:
    """Embeddings of ``texts`` (float32, one row per text), from the cache or from ``encoder``.

    Texts are encoded longest first so that batches hold texts of similar length (less padding),
    then put back in their order. ``prompt`` is passed only to encoders that declare it in a
    ``prompts`` mapping (sentence-transformers style); others embed the raw text.
    """
    if not texts:
        raise AdaptError("nothing to embed: the task has no texts")
    path = cache.path(model_key, model_name, prompt, texts)
    cached = cache.get(path, len(texts))
    if cached is not None:
        cache.hits += 1
        return cached
    cache.misses += 1
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    prompts = getattr(encoder, "prompts", None) or {}
    kwargs = {"prompt_name": prompt} if prompt and prompt in prompts else {}
    with warnings.catch_warnings():  # texts beyond max_length are cut on purpose in a benchmark
        warnings.filterwarnings("ignore", message=r".*were truncated")
        out = encoder.encode([texts[i] for i in order], batch_size=batch_size, show_progress=False, **kwargs)
    out = np.asarray(out, dtype=np.float32)
    if out.ndim != 2 or out.shape[0] != len(texts):
        raise AdaptError(f"{model_name}: encode returned shape {out.shape} for {len(texts)} texts; expected (n, dim)")
    if not np.isfinite(out).all():
        raise AdaptError(f"{model_name}: encode returned NaN or infinite values; the model is broken "
                         "(try dtype=float32)")
    emb = np.empty_like(out)
    emb[np.asarray(order)] = out
    cache.put(path, emb)
    return emb

"""BM25 (``bm25s``, PyPI) as a lexical baseline on retrieval tasks, next to the encoders.

Texts are lower-cased, split into ``[a-z0-9]+`` words and stripped of scikit-learn's English stop
words; no stemming. Scores use bm25s's defaults (Lucene BM25, k1 = 1.5, b = 0.75). Documents with a
BM25 score of 0 (no query word) are not retrieved, so a query without a known word scores 0 instead
of being credited for an arbitrary order. Other task kinds have no BM25 score (``-`` in reports).
"""
from __future__ import annotations

import re

import numpy as np

from adapt.bench.stats import ItemScores
from adapt.bench.tasks import RetrievalTask
from adapt.errors import DataError

_WORD = re.compile(r"[a-z0-9]+")


def tokenize(texts: list[str]) -> list[list[str]]:
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    return [[w for w in _WORD.findall(text.lower()) if w not in ENGLISH_STOP_WORDS] or ["_empty_"] for text in texts]


def bm25_ranking(queries: list[str], corpus: list[str], k: int = 100) -> np.ndarray:
    """Top ``k`` corpus indices per query, best first; -1 where fewer documents share a word: (Q, k)."""
    try:
        import bm25s
    except ImportError:
        raise DataError("the BM25 baseline needs bm25s: pip install bm25s") from None
    retriever = bm25s.BM25()
    retriever.index(tokenize(corpus), show_progress=False)
    k = min(k, len(corpus))
    docs, scores = retriever.retrieve(tokenize(queries), k=k, show_progress=False, n_threads=1)
    return np.where(np.asarray(scores) > 0, np.asarray(docs), -1)


class BM25Baseline:
    """Scores retrieval tasks with BM25 (``evaluate`` returns None for other kinds); not an encoder."""

    name = "BM25"
    fingerprint = "bm25s"

    def evaluate(self, task) -> tuple[dict[str, float], ItemScores] | None:
        if not isinstance(task, RetrievalTask):
            return None
        return task.evaluate_ranking(bm25_ranking(task.queries, task.corpus))

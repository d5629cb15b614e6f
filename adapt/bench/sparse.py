"""Sparse (SPLADE) encoders on retrieval tasks: dot products of sparse vectors, and how sparse they are.

A folder that ``SparseEncoder`` loads (``adapt export --kind sparse``, ``--stages mlm,splade``) is scored
on every retrieval task like an encoder (nDCG@10, MRR@10, Recall@100, with the per-query evidence the
bootstrap resamples), plus ``active_terms_query`` and ``active_terms_doc`` (average non-zero weights per
vector) and ``index_mb`` (the corpus as (term id, weight) pairs of 4 + 4 bytes). Documents that share no
term with a query (score 0) are not retrieved, as BM25 does. Other task kinds are not scored (``-``).
"""
from __future__ import annotations

import numpy as np

from adapt.bench.stats import ItemScores
from adapt.bench.tasks import RetrievalTask
from adapt.inference.sparse import SparseModel, load_sparse


def rank_sparse(queries, corpus, k: int = 100) -> np.ndarray:
    """Top ``k`` corpus rows per query by dot product of CSR matrices, best first (ties in corpus order);
    -1 past the documents with a positive score: (Q, k)."""
    k = min(k, corpus.shape[0])
    out = np.full((queries.shape[0], k), -1, dtype=np.int64)
    corpus_t = corpus.T.tocsc()
    for start in range(0, queries.shape[0], 256):  # (256, N) score blocks keep memory bounded
        scores = (queries[start:start + 256] @ corpus_t).toarray()
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(scores, order, axis=1)
        out[start:start + 256] = np.where(top > 0, order, -1)
    return out


class SparseRetriever:
    """Scores retrieval tasks with a sparse encoder (``evaluate`` returns None for other kinds)."""

    def __init__(self, model: SparseModel):
        self.model, self.name, self.fingerprint = model, model.name, model.fingerprint

    def evaluate(self, task, batch_size: int = 32) -> tuple[dict[str, float], ItemScores] | None:
        if not isinstance(task, RetrievalTask):
            return None
        groups = task.groups()
        queries = self.model.encode(groups["queries"].texts, batch_size=batch_size,
                                    prompt_name=groups["queries"].prompt)
        corpus = self.model.encode(groups["corpus"].texts, batch_size=batch_size, prompt_name=groups["corpus"].prompt)
        scores, evidence = task.evaluate_ranking(rank_sparse(queries, corpus))
        scores.update(active_terms_query=float(np.diff(queries.indptr).mean()),
                      active_terms_doc=float(np.diff(corpus.indptr).mean()), index_mb=corpus.nnz * 8 / 1e6)
        return scores, evidence


def load_sparse_retriever(source, *, dtype: str = "auto", max_length: int | None = None,
                          device: str | None = None) -> SparseRetriever:
    return SparseRetriever(load_sparse(source, dtype=dtype, max_length=max_length, device=device))

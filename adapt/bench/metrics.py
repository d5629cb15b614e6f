"""Benchmark metrics on plain numpy arrays: retrieval, classification, similarity, clustering.

Retrieval follows the trec_eval / BEIR conventions: graded relevance with linear gain
(``rel / log2(rank + 1)``), judgements of 0 count as not relevant, and the ideal DCG ranks every
judged-relevant document of the query. Ties in scores break by corpus order (stable sort), so the
numbers are deterministic.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

SEED = 0  # every randomised metric (logistic regression, k-means) uses this fixed seed


def ndcg_at_k(ranked: Sequence[str], qrels: Mapping[str, float], k: int = 10) -> float:
    """nDCG@k of one ranked list of document ids against ``{doc_id: relevance}`` judgements."""
    gains = [float(qrels.get(doc, 0.0)) for doc in ranked[:k]]
    dcg = sum(g / np.log2(i + 2) for i, g in enumerate(gains) if g > 0)
    ideal = sorted((float(r) for r in qrels.values() if r > 0), reverse=True)[:k]
    idcg = sum(g / np.log2(i + 2) for i, g in enumerate(ideal))
    return float(dcg / idcg) if idcg > 0 else 0.0


def mrr_at_k(ranked: Sequence[str], qrels: Mapping[str, float], k: int = 10) -> float:
    """Reciprocal rank of the first relevant document within the top ``k`` (0 when none)."""
    for i, doc in enumerate(ranked[:k]):
        if qrels.get(doc, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def recall_at_k(ranked: Sequence[str], qrels: Mapping[str, float], k: int = 100) -> float:
    """Share of the query's relevant documents that appear in the top ``k``."""
    relevant = {doc for doc, r in qrels.items() if r > 0}
    if not relevant:
        return 0.0
    return len(relevant.intersection(ranked[:k])) / len(relevant)


def rank_corpus(query_emb: np.ndarray, corpus_emb: np.ndarray, k: int) -> np.ndarray:
    """Indices of the top ``k`` corpus rows for each query by cosine similarity, best first: (Q, k)."""
    q = _unit(query_emb)
    c = _unit(corpus_emb)
    k = min(k, c.shape[0])
    out = np.empty((q.shape[0], k), dtype=np.int64)
    for start in range(0, q.shape[0], 256):  # (256, N) score blocks keep memory bounded
        scores = q[start:start + 256] @ c.T
        out[start:start + 256] = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return out


def retrieval_per_query(query_ids: Sequence[str], top: np.ndarray, corpus_ids: Sequence[str],
                        qrels: Mapping[str, Mapping[str, float]]) -> dict[str, np.ndarray]:
    """Per-query nDCG@10, MRR@10 and Recall@100 of a ranking ``top`` (Q, k) of corpus indices, over the
    queries that have at least one relevant document (in ``query_ids`` order)."""
    per_metric: dict[str, list[float]] = {"ndcg@10": [], "mrr@10": [], "recall@100": []}
    for qi, qid in enumerate(query_ids):
        judged = qrels.get(qid, {})
        if not any(r > 0 for r in judged.values()):
            continue
        ranked = [corpus_ids[j] for j in top[qi] if j >= 0]  # -1: nothing retrieved at that rank
        per_metric["ndcg@10"].append(ndcg_at_k(ranked, judged, 10))
        per_metric["mrr@10"].append(mrr_at_k(ranked, judged, 10))
        per_metric["recall@100"].append(recall_at_k(ranked, judged, 100))
    if not per_metric["ndcg@10"]:
        raise ValueError("no query has a relevant document")
    return {name: np.asarray(values) for name, values in per_metric.items()}


def retrieval_scores(query_ids: Sequence[str], query_emb: np.ndarray, corpus_ids: Sequence[str],
                     corpus_emb: np.ndarray, qrels: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Mean nDCG@10, MRR@10 and Recall@100 over the queries that have at least one relevant document."""
    per_query = retrieval_per_query(query_ids, rank_corpus(query_emb, corpus_emb, 100), corpus_ids, qrels)
    return {name: float(np.mean(values)) for name, values in per_query.items()}


def accuracy(y_true: Sequence, y_pred: Sequence) -> float:
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    return float((y_true == y_pred).mean())


def macro_f1(y_true: Sequence, y_pred: Sequence) -> float:
    """Unweighted mean of per-class F1 over the classes present in ``y_true`` or ``y_pred``."""
    from sklearn.metrics import f1_score

    return float(f1_score(np.asarray(y_true), np.asarray(y_pred), average="macro", zero_division=0))


def classification_scores(train_emb: np.ndarray, train_labels: Sequence, test_emb: np.ndarray,
                          test_labels: Sequence, seed: int = SEED) -> dict[str, float]:
    """Logistic regression on frozen embeddings: accuracy and macro-F1 on the test split."""
    pred = classification_predictions(train_emb, train_labels, test_emb, seed)
    return {"accuracy": accuracy(test_labels, pred), "macro_f1": macro_f1(test_labels, pred)}


def classification_predictions(train_emb: np.ndarray, train_labels: Sequence, test_emb: np.ndarray,
                               seed: int = SEED) -> np.ndarray:
    """Test-split predictions of a logistic regression fitted on frozen training embeddings.

    Embeddings are L2-normalised and standardised with statistics of the training split, so decoders
    whose hidden states have a few huge dimensions are compared fairly with trained encoders.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(_unit(train_emb))
    clf = LogisticRegression(max_iter=2000, random_state=seed)
    clf.fit(scaler.transform(_unit(train_emb)), np.asarray(train_labels))
    return clf.predict(scaler.transform(_unit(test_emb)))


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); 0 when either side is constant."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    return float(spearmanr(x, y).statistic)


def cosine_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two (n, d) arrays."""
    return np.sum(_unit(a) * _unit(b), axis=1)


def similarity_scores(emb1: np.ndarray, emb2: np.ndarray, gold: Sequence[float]) -> dict[str, float]:
    """Spearman correlation between pair cosine similarities and gold scores."""
    return {"spearman": spearman(cosine_pairs(emb1, emb2), gold)}


def v_measure(labels_true: Sequence, labels_pred: Sequence) -> float:
    from sklearn.metrics import v_measure_score

    return float(v_measure_score(np.asarray(labels_true), np.asarray(labels_pred)))


def clustering_scores(emb: np.ndarray, labels: Sequence, seed: int = SEED) -> dict[str, float]:
    """k-means (k = number of gold labels, fixed seed) on unit embeddings, scored by V-measure."""
    return {"v_measure": v_measure(labels, cluster_ids(emb, len(set(labels)), seed))}


def cluster_ids(emb: np.ndarray, k: int, seed: int = SEED) -> np.ndarray:
    """k-means cluster of each row of ``emb`` (unit-normalised first; 10 inits, fixed seed)."""
    from sklearn.cluster import KMeans

    return KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(_unit(emb))


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)

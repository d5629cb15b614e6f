"""Benchmark metrics against values computed by hand on toy inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from adapt.bench import metrics

L2 = math.log2


def test_ndcg_binary_relevance():
    # relevant at ranks 2 and 3: DCG = 1/log2(3) + 1/log2(4); ideal: ranks 1 and 2 = 1 + 1/log2(3)
    got = metrics.ndcg_at_k(["d1", "d2", "d3"], {"d2": 1, "d3": 1}, 10)
    assert got == pytest.approx((1 / L2(3) + 1 / L2(4)) / (1 + 1 / L2(3)))
    assert got == pytest.approx(0.693426, abs=1e-6)


def test_ndcg_graded_relevance_uses_linear_gain_and_ideal_order():
    # a (rel 1) at rank 1, c (rel 2) at rank 3: DCG = 1 + 2/log2(4) = 2; IDCG = 2 + 1/log2(3)
    got = metrics.ndcg_at_k(["a", "b", "c"], {"a": 1, "c": 2}, 10)
    assert got == pytest.approx(2 / (2 + 1 / L2(3)))
    assert got == pytest.approx(0.760188, abs=1e-6)
    assert metrics.ndcg_at_k(["c", "a", "b"], {"a": 1, "c": 2}, 10) == pytest.approx(1.0)


def test_ndcg_cutoff_and_unjudged_query():
    ranked = [f"x{i}" for i in range(10)] + ["hit"]
    assert metrics.ndcg_at_k(ranked, {"hit": 1}, 10) == 0.0
    assert metrics.ndcg_at_k(ranked, {"hit": 1}, 11) == pytest.approx(1 / L2(12))
    assert metrics.ndcg_at_k(["a"], {}, 10) == 0.0
    # the ideal DCG counts relevant documents the ranking missed
    assert metrics.ndcg_at_k(["a"], {"a": 1, "zz": 1}, 10) == pytest.approx(1 / (1 + 1 / L2(3)))


def test_mrr_at_10():
    assert metrics.mrr_at_k(["a", "b", "c"], {"c": 1, "b": 0}, 10) == pytest.approx(1 / 3)  # 0 = judged non-relevant
    assert metrics.mrr_at_k(["a", "b"], {"b": 2, "a": 1}, 10) == 1.0
    assert metrics.mrr_at_k([f"x{i}" for i in range(10)] + ["c"], {"c": 1}, 10) == 0.0


def test_recall_at_k():
    ranked = ["a", "b", "c", "d"]
    assert metrics.recall_at_k(ranked, {"b": 1, "z": 1}, 100) == 0.5
    assert metrics.recall_at_k(ranked, {"a": 1, "d": 3}, 2) == 0.5
    assert metrics.recall_at_k(ranked, {"a": 0}, 100) == 0.0


def test_retrieval_scores_end_to_end_with_known_ranking():
    # 2-d embeddings: query q1 points at d1 then d2 then d3; q2 at d3 first; q3 has no positive judgement
    corpus = np.array([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]], dtype=np.float32)
    queries = np.array([[1.0, 0.1], [0.0, 1.0], [1.0, 0.0]], dtype=np.float32)
    qrels = {"q1": {"d2": 1}, "q2": {"d3": 1, "d1": 1}, "q3": {"d1": 0}}
    got = metrics.retrieval_scores(["q1", "q2", "q3"], queries, ["d1", "d2", "d3"], corpus, qrels)
    # q1 ranks d1, d2, d3 -> relevant d2 at rank 2; q2 ranks d3, d2, d1 -> relevant at 1 and 3
    ndcg_q1 = (1 / L2(3)) / 1
    ndcg_q2 = (1 + 1 / L2(4)) / (1 + 1 / L2(3))
    assert got["ndcg@10"] == pytest.approx((ndcg_q1 + ndcg_q2) / 2)
    assert got["mrr@10"] == pytest.approx((0.5 + 1.0) / 2)
    assert got["recall@100"] == pytest.approx(1.0)


def test_retrieval_scores_ties_break_by_corpus_order():
    corpus = np.ones((3, 2), dtype=np.float32)
    got = metrics.retrieval_scores(["q"], np.ones((1, 2)), ["a", "b", "c"], corpus, {"q": {"b": 1}})
    assert got["mrr@10"] == 0.5


def test_accuracy_and_macro_f1():
    y_true, y_pred = ["a", "a", "b", "b"], ["a", "b", "b", "b"]
    assert metrics.accuracy(y_true, y_pred) == 0.75
    # F1(a) = 2*1*0.5/1.5 = 2/3, F1(b) = 2*(2/3)*1/(5/3) = 0.8
    assert metrics.macro_f1(y_true, y_pred) == pytest.approx((2 / 3 + 0.8) / 2)


def test_classification_scores_on_separable_data():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(20, 4)) + [5, 0, 0, 0]
    b = rng.normal(size=(20, 4)) - [5, 0, 0, 0]
    x = np.concatenate([a, b]).astype(np.float32)
    y = ["a"] * 20 + ["b"] * 20
    got = metrics.classification_scores(x[::2], y[::2], x[1::2], y[1::2])
    assert got == {"accuracy": 1.0, "macro_f1": 1.0}


def test_spearman_with_and_without_ties():
    # d = [0, -1, 1, 0]: 1 - 6*2 / (4*(16-1)) = 0.8
    assert metrics.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ranks [1, 2.5, 2.5, 4] vs [1, 2, 3, 4]: Pearson = 4.5 / sqrt(4.5 * 5)
    assert metrics.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert metrics.spearman([1, 1, 1], [1, 2, 3]) == 0.0


def test_similarity_scores_uses_cosine():
    e1 = np.array([[1, 0], [1, 0], [1, 0]], dtype=np.float32)
    e2 = np.array([[2, 0], [1, 1], [0, 3]], dtype=np.float32)  # cosines 1, 0.707, 0
    assert metrics.similarity_scores(e1, e2, [3.0, 2.0, 1.0])["spearman"] == pytest.approx(1.0)
    assert metrics.similarity_scores(e1, e2, [1.0, 2.0, 3.0])["spearman"] == pytest.approx(-1.0)


def test_v_measure():
    # homogeneity h = 1 - H(C|K)/H(C) = 1 - 0.75*H(1/3)/1; completeness c = 1 - H(K|C)/H(K) = 1 - 0.5/H(1/4)
    def h2(p):
        return -p * L2(p) - (1 - p) * L2(1 - p)

    h = 1 - 0.75 * h2(1 / 3)
    c = 1 - 0.5 / h2(1 / 4)
    assert metrics.v_measure([0, 0, 1, 1], [0, 0, 0, 1]) == pytest.approx(2 * h * c / (h + c))
    assert metrics.v_measure([0, 0, 1, 1], [0, 0, 0, 1]) == pytest.approx(0.343711, abs=1e-6)
    assert metrics.v_measure(["x", "x", "y", "y"], [1, 1, 0, 0]) == pytest.approx(1.0)


def test_clustering_scores_on_separated_blobs():
    x = np.array([[1, 0.01 * i] for i in range(10)] + [[0.01 * i, 1] for i in range(10)], dtype=np.float32)
    assert metrics.clustering_scores(x, ["a"] * 10 + ["b"] * 10)["v_measure"] == pytest.approx(1.0)

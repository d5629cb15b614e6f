"""Benchmark tasks held in memory: retrieval, classification, pair similarity, clustering.

A task names the texts it needs embedded (``groups``: one list of texts per role, each with an
optional prompt name such as ``"query"``) and scores the embeddings of those groups (``evaluate``:
the scores and the per-item evidence of the main metric that ``stats`` resamples; ``score``: the
scores alone).
Where the texts come from (the offline suite, a user folder) is the business of ``quick.py`` and
``folders.py``; how embeddings are made and cached is the business of ``runner.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from adapt.bench import metrics
from adapt.bench.stats import ItemScores

KINDS = ("retrieval", "classification", "similarity", "clustering")


@dataclass(frozen=True)
class TextGroup:
    """Texts embedded together; ``prompt`` is a prompt name passed to encoders that define it."""

    texts: list[str]
    prompt: str | None = None


@dataclass
class Task:
    """Base class: ``name`` is unique within a run, ``main_metric`` is the one the report tabulates."""

    name: str
    description: str = ""
    kind = "task"
    main_metric = ""

    def groups(self) -> dict[str, TextGroup]:
        raise NotImplementedError

    def evaluate(self, embeddings: dict[str, np.ndarray]) -> tuple[dict[str, float], ItemScores]:
        """(metric -> value, per-item evidence of ``main_metric`` for the bootstrap)."""
        raise NotImplementedError

    def score(self, embeddings: dict[str, np.ndarray]) -> dict[str, float]:
        return self.evaluate(embeddings)[0]

    @property
    def n(self) -> int:
        """Number of evaluated examples (queries, test texts, pairs or clustered texts)."""
        raise NotImplementedError

    def limited(self, limit: int) -> Task:
        """A smaller copy (at most ``limit`` examples per split) for smoke runs."""
        raise NotImplementedError

    def to_dict(self) -> dict:
        return {"kind": self.kind, **dataclasses.asdict(self)}

    @staticmethod
    def from_dict(data: dict) -> Task:
        data = dict(data)
        cls = TASK_CLASSES[data.pop("kind")]
        return cls(**data)


@dataclass
class RetrievalTask(Task):
    """Queries against a corpus; ``qrels[query_id][doc_id]`` is a graded relevance (0 = not relevant)."""

    query_ids: list[str] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    corpus_ids: list[str] = field(default_factory=list)
    corpus: list[str] = field(default_factory=list)
    qrels: dict[str, dict[str, float]] = field(default_factory=dict)
    kind = "retrieval"
    main_metric = "ndcg@10"

    def groups(self) -> dict[str, TextGroup]:
        return {"queries": TextGroup(self.queries, "query"), "corpus": TextGroup(self.corpus, "document")}

    def evaluate(self, embeddings):
        return self.evaluate_ranking(metrics.rank_corpus(embeddings["queries"], embeddings["corpus"], 100))

    def evaluate_ranking(self, top: np.ndarray):
        """Scores of a ranking ``top`` (queries, k) of corpus indices, from any retriever (BM25 too)."""
        per_query = metrics.retrieval_per_query(self.query_ids, top, self.corpus_ids, self.qrels)
        return {k: float(np.mean(v)) for k, v in per_query.items()}, ItemScores("mean", per_query["ndcg@10"])

    @property
    def n(self) -> int:
        return sum(1 for q in self.query_ids if any(r > 0 for r in self.qrels.get(q, {}).values()))

    def limited(self, limit):
        qids = self.query_ids[:limit]
        keep = {d for q in qids for d in self.qrels.get(q, {})}
        keep.update(self.corpus_ids[:limit])
        idx = [i for i, d in enumerate(self.corpus_ids) if d in keep]
        return dataclasses.replace(self, query_ids=qids, queries=self.queries[:limit],
                                   corpus_ids=[self.corpus_ids[i] for i in idx],
                                   corpus=[self.corpus[i] for i in idx],
                                   qrels={q: self.qrels[q] for q in qids if q in self.qrels})


@dataclass
class ClassificationTask(Task):
    """Logistic regression on frozen embeddings of ``train`` texts, scored on ``test`` texts."""

    train_texts: list[str] = field(default_factory=list)
    train_labels: list[str] = field(default_factory=list)
    test_texts: list[str] = field(default_factory=list)
    test_labels: list[str] = field(default_factory=list)
    kind = "classification"
    main_metric = "accuracy"

    def groups(self):
        # one group, train then test, so a clustering task over the same texts reuses the embeddings
        return {"texts": TextGroup(self.train_texts + self.test_texts)}

    def evaluate(self, embeddings):
        emb = embeddings["texts"]
        n_train = len(self.train_texts)
        pred = metrics.classification_predictions(emb[:n_train], self.train_labels, emb[n_train:])
        scores = {"accuracy": metrics.accuracy(self.test_labels, pred), "macro_f1": metrics.macro_f1(self.test_labels, pred)}
        return scores, ItemScores("mean", (np.asarray(self.test_labels) == pred).astype(float))

    @property
    def n(self) -> int:
        return len(self.test_texts)

    def limited(self, limit):
        train, test = balanced_head(self.train_labels, limit), balanced_head(self.test_labels, limit)
        return dataclasses.replace(self, train_texts=[self.train_texts[i] for i in train],
                                   train_labels=[self.train_labels[i] for i in train],
                                   test_texts=[self.test_texts[i] for i in test],
                                   test_labels=[self.test_labels[i] for i in test])


@dataclass
class SimilarityTask(Task):
    """Pairs of texts with a gold similarity; Spearman of cosine similarity against the gold scores.

    Texts are stored once (``texts``) and pairs index into them, so a matrix of ratings over a few
    documents (like Lee's 50 x 50) embeds each document once.
    """

    texts: list[str] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    kind = "similarity"
    main_metric = "spearman"

    @classmethod
    def from_pairs(cls, name: str, text_pairs: list[tuple[str, str]], scores: list[float],
                   description: str = "") -> SimilarityTask:
        index: dict[str, int] = {}
        pairs = [(index.setdefault(a, len(index)), index.setdefault(b, len(index))) for a, b in text_pairs]
        return cls(name=name, description=description, texts=list(index), pairs=pairs, scores=list(scores))

    def groups(self):
        return {"texts": TextGroup(self.texts)}

    def evaluate(self, embeddings):
        emb = embeddings["texts"]
        first = np.array([i for i, _ in self.pairs], dtype=np.int64)
        second = np.array([j for _, j in self.pairs], dtype=np.int64)
        cosine = metrics.cosine_pairs(emb[first], emb[second])
        return ({"spearman": metrics.spearman(cosine, self.scores)},
                ItemScores("spearman", np.stack([cosine, np.asarray(self.scores, dtype=np.float64)], axis=1)))

    @property
    def n(self) -> int:
        return len(self.pairs)

    def limited(self, limit):
        pairs = [tuple(p) for p in self.pairs[:limit]]
        used = sorted({i for p in pairs for i in p})
        new = {old: k for k, old in enumerate(used)}
        return dataclasses.replace(self, texts=[self.texts[i] for i in used],
                                   pairs=[(new[a], new[b]) for a, b in pairs], scores=self.scores[:limit])


@dataclass
class ClusteringTask(Task):
    """k-means over the embeddings of ``texts`` with k = number of gold labels, scored by V-measure."""

    texts: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    kind = "clustering"
    main_metric = "v_measure"

    def groups(self):
        return {"texts": TextGroup(self.texts)}

    def evaluate(self, embeddings):
        codes = {label: i for i, label in enumerate(dict.fromkeys(self.labels))}
        pred = metrics.cluster_ids(embeddings["texts"], len(codes))
        gold = np.array([codes[label] for label in self.labels])
        return {"v_measure": metrics.v_measure(gold, pred)}, ItemScores("v_measure", np.stack([gold, pred], axis=1))

    @property
    def n(self) -> int:
        return len(self.texts)

    def limited(self, limit):
        keep = balanced_head(self.labels, limit)
        return dataclasses.replace(self, texts=[self.texts[i] for i in keep], labels=[self.labels[i] for i in keep])


@dataclass
class FinetuneTask(Task):
    """A model fine-tuned on ``train`` (examples and labels) and scored on ``eval`` (``adapt bench --suite
    finetune``; :mod:`adapt.bench.finetuned` runs it, no embeddings). ``examples``: ``sequence`` (texts),
    ``pair`` (``[text, text_pair]``) or ``token`` (word lists, a tag list each)."""

    examples: str = "sequence"
    train_examples: list = field(default_factory=list)
    train_labels: list = field(default_factory=list)
    eval_examples: list = field(default_factory=list)
    eval_labels: list = field(default_factory=list)
    kind = "fine-tuned"
    main_metric = "accuracy"

    def groups(self):
        return {}

    def evaluate(self, embeddings):
        raise TypeError(f"{self.name} is scored by fine-tuning a model (adapt.bench.finetuned), not on embeddings")

    @property
    def n(self) -> int:
        """Scored items: texts, pairs, or (token tasks) words."""
        return sum(map(len, self.eval_labels)) if self.examples == "token" else len(self.eval_labels)

    def limited(self, limit):
        first = (lambda y: y[0]) if self.examples == "token" else (lambda y: y)
        train = balanced_head([first(y) for y in self.train_labels], limit)
        test = balanced_head([first(y) for y in self.eval_labels], limit)
        return dataclasses.replace(self, train_examples=[self.train_examples[i] for i in train],
                                   train_labels=[self.train_labels[i] for i in train],
                                   eval_examples=[self.eval_examples[i] for i in test],
                                   eval_labels=[self.eval_labels[i] for i in test])


def balanced_head(labels: list[str], limit: int) -> list[int]:
    """Up to ``limit`` indices taken round-robin over the labels (so every label stays), in order."""
    queues = {label: [i for i, x in enumerate(labels) if x == label] for label in dict.fromkeys(labels)}
    keep: list[int] = []
    while len(keep) < min(limit, len(labels)):
        for queue in queues.values():
            if queue and len(keep) < limit:
                keep.append(queue.pop(0))
    return sorted(keep)


TASK_CLASSES: dict[str, type[Task]] = {
    "retrieval": RetrievalTask,
    "classification": ClassificationTask,
    "similarity": SimilarityTask,
    "clustering": ClusteringTask,
    "fine-tuned": FinetuneTask,
}

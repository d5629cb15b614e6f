"""The offline quick suite: loaders give deterministic, non-empty tasks; the pickle reader is strict."""
from __future__ import annotations

import io
import json
import pickle
import re

import pytest

pytest.importorskip("gensim")  # the quick suite's text ships with gensim (the "offline" extra)

from adapt.bench.suites import quick  # noqa: E402
from adapt.bench.tasks import ClassificationTask, ClusteringTask, RetrievalTask, SimilarityTask, Task  # noqa: E402
from adapt.errors import DataError  # noqa: E402


@pytest.fixture(scope="module")
def built():
    """Every quick task built once from gensim's files (no cache involved)."""
    return {name: builder() for name, builder in quick.BUILDERS.items()}


def test_lee_similarity(built):
    task = built["lee-similarity"]
    assert isinstance(task, SimilarityTask)
    assert len(task.texts) == 50 and task.n == 50 * 49 // 2
    assert all(i < j for i, j in task.pairs) and all(0 <= s <= 1 for s in task.scores)


def test_classification_tasks_are_stratified_and_disjoint(built):
    for name in ("polarity-classification", "newsgroup-classification"):
        task = built[name]
        assert isinstance(task, ClassificationTask)
        assert len(set(task.train_labels)) == 2 and len(task.test_texts) >= 90
        for split in (task.train_labels, task.test_labels):
            counts = {label: split.count(label) for label in set(split)}
            assert max(counts.values()) - min(counts.values()) <= 2, (name, counts)
        assert not set(task.train_texts) & set(task.test_texts)


def test_newsgroup_posts_lose_the_headers_that_name_the_group(built):
    task = built["newsgroup-classification"]
    texts = task.train_texts + task.test_texts
    assert not any(t.startswith(("Newsgroups:", "Path:", "From:", "Xref:")) for t in texts)
    assert sum("alt.atheism" in t for t in texts) < 5
    assert set(task.train_labels) == {"alt.atheism", "sci.space"}
    clustering = built["newsgroup-clustering"]
    assert isinstance(clustering, ClusteringTask) and clustering.texts == texts  # same texts: shared embeddings


def test_wiki_retrieval(built):
    task = built["wiki-retrieval"]
    assert isinstance(task, RetrievalTask)
    assert 80 <= len(task.queries) <= 106 and len(task.corpus) >= 2 * len(task.queries)
    assert len(set(task.corpus_ids)) == len(task.corpus_ids)
    assert task.queries[0].startswith("Anarchism is")
    passages = [_runs(p) for p in task.corpus]
    for qid, query in zip(task.query_ids, task.queries):
        relevant = [task.corpus[task.corpus_ids.index(d)] for d in task.qrels[qid]]
        assert 2 <= len(relevant) <= quick.PASSAGES_PER_ARTICLE
        # the query's words are not found verbatim anywhere in the corpus (its own article's passages or any
        # other's): no run of RUN words in common, punctuation and case aside
        runs = _runs(query)
        assert not any(runs & p for p in passages), query
    assert not any("'''" in p or p.startswith("=") for p in task.corpus)


RUN = 8  # words: the shortest verbatim run the leak check looks for


def _runs(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + RUN]) for i in range(len(words) - RUN + 1)}


def test_the_leak_check_finds_a_query_copied_into_a_passage():
    query = "Anarchism is a political philosophy that advocates self-governed societies."
    assert _runs(query) & _runs("Some say that anarchism is a political philosophy, that advocates self governed ones.")
    assert not _runs(query) & _runs("Anarchism is a political philosophy of some kind, and others disagree.")


def test_builders_are_deterministic_and_the_cache_round_trips(built, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    for name in ("polarity-classification", "newsgroup-classification", "lee-similarity"):
        assert quick.BUILDERS[name]().to_dict() == built[name].to_dict()
    for name, task in built.items():
        monkeypatch.setitem(quick.BUILDERS, name, lambda task=task: task)  # no second Wikipedia parse
        first = quick.load_quick_task(name)  # "builds" and writes the cache
        assert (quick.cache_dir() / f"quick-v{quick.VERSION}" / f"{name}.json").exists()
        again = quick.load_quick_task(name)  # reads the cache
        assert json.dumps(again.to_dict()) == json.dumps(first.to_dict()) == json.dumps(task.to_dict())
        assert again.groups().keys() == task.groups().keys()


def test_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    path = quick.cache_dir() / f"quick-v{quick.VERSION}" / "polarity-classification.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert quick.load_quick_task("polarity-classification").n == 100
    assert Task.from_dict(json.loads(path.read_text())).n == 100


def test_unknown_quick_task():
    with pytest.raises(DataError, match="unknown quick task"):
        quick.load_quick_task("nope")


class _Evil:
    def __reduce__(self):
        import os

        return (os.getcwd, ())


@pytest.mark.parametrize("payload", [_Evil(), {"data": _Evil()}, [1, 2, _Evil()]])
def test_bunch_unpickler_refuses_other_globals(payload):
    raw = pickle.dumps(payload, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        quick._BunchUnpickler(io.BytesIO(raw)).load()


def test_stratified_split_is_deterministic():
    labels = ["a"] * 7 + ["b"] * 3
    first = quick.stratified_split(labels)
    assert first == quick.stratified_split(labels)
    train, test = first
    assert sorted(train + test) == list(range(10))
    assert [labels[i] for i in test].count("b") in (1, 2)


def test_the_suites_registry_finds_every_family_and_its_tasks():
    """adapt.bench.suites: a module declaring SUITES is a task family; its tasks resolve by name."""
    from adapt.bench import suites
    from adapt.bench.runner import SUITE_HELP, SUITES, resolve_task

    assert list(SUITES)[:3] == ["quick", "standard", "standard-dev"] and {"mteb-lite", "mteb-mock"} <= set(SUITES)
    assert set(SUITE_HELP) == set(SUITES)
    assert suites.task_loader("lee-similarity") is quick.load_task
    assert suites.task_loader("simlex-similarity-dev").__module__ == "adapt.bench.suites.standard"
    assert suites.task_loader("MockSTSTask") is None  # mteb's: resolved by mteb
    assert resolve_task("lee-similarity").name == "lee-similarity"

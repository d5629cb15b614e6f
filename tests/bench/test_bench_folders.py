"""Local task folders: each documented format loads, and malformed files name file, line and field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapt.bench.suites.folders import load_task_folder
from adapt.bench.tasks import ClassificationTask, ClusteringTask, RetrievalTask, SimilarityTask
from adapt.errors import DataError


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")


def make_retrieval(root: Path) -> Path:
    write_jsonl(root / "corpus.jsonl", [{"_id": "d1", "title": "Cats", "text": "cats purr"},
                                        {"_id": 2, "text": "dogs bark"}])
    write_jsonl(root / "queries.jsonl", [{"_id": "q1", "text": "purring"}, {"_id": "q2", "text": "barking"}])
    (root / "qrels").mkdir()
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t2\nq2\t2\t1\nq2\td1\t0\n")
    return root


def make_classification(root: Path) -> Path:
    write_jsonl(root / "train.jsonl", [{"text": "good", "label": "pos"}, {"text": "bad", "label": "neg"}])
    write_jsonl(root / "test.jsonl", [{"text": "fine", "label": "pos"}])
    return root


def make_similarity(root: Path) -> Path:
    write_jsonl(root / "pairs.jsonl", [{"text1": "a cat", "text2": "a kitten", "score": 4.5},
                                       {"text1": "a cat", "text2": "a car", "score": 1}])
    return root


def make_clustering(root: Path) -> Path:
    write_jsonl(root / "clustering.jsonl", [{"text": "x", "label": 0}, {"text": "y", "label": 1}])
    return root


def test_retrieval_folder(tmp_path):
    task = load_task_folder(make_retrieval(tmp_path / "beir"))
    assert isinstance(task, RetrievalTask) and task.name == "beir"
    assert task.corpus_ids == ["d1", "2"] and task.corpus == ["Cats cats purr", "dogs bark"]
    assert task.qrels == {"q1": {"d1": 2.0}, "q2": {"2": 1.0, "d1": 0.0}}
    assert task.n == 2 and set(task.groups()) == {"queries", "corpus"}


def test_classification_similarity_clustering_folders(tmp_path):
    cls = load_task_folder(make_classification(tmp_path / "cls"))
    assert isinstance(cls, ClassificationTask) and cls.train_labels == ["pos", "neg"] and cls.n == 1
    sim = load_task_folder(make_similarity(tmp_path / "sim"))
    assert isinstance(sim, SimilarityTask)
    assert sim.texts == ["a cat", "a kitten", "a car"] and sim.pairs == [(0, 1), (0, 2)] and sim.scores == [4.5, 1.0]
    clu = load_task_folder(make_clustering(tmp_path / "clu"))
    assert isinstance(clu, ClusteringTask) and clu.labels == ["0", "1"]


def test_task_json_sets_kind_and_name(tmp_path):
    root = make_similarity(tmp_path / "x")
    write_jsonl(root / "train.jsonl", [{"text": "a", "label": 1}])  # files of two kinds: needs task.json
    with pytest.raises(DataError, match="task.json"):
        load_task_folder(root)
    (root / "task.json").write_text(json.dumps({"kind": "similarity", "name": "my-sts"}))
    task = load_task_folder(root)
    assert task.name == "my-sts" and task.kind == "similarity"


def _set(root: Path, rel: str, text: str) -> None:
    (root / rel).write_text(text, encoding="utf-8")


MALFORMED = [
    # (maker, file, content, expected fragments of the message)
    (make_retrieval, "corpus.jsonl", '{"_id": "d1", "text": "x"}\n{"title": "t", "text": "y"}\n',
     ["corpus.jsonl", "line 2", "'_id'", "missing"]),
    (make_retrieval, "corpus.jsonl", '{"_id": "d1", "text": "x"}\n{"_id": "d1", "text": "y"}\n',
     ["corpus.jsonl", "line 2", "'_id'", "repeats line 1"]),
    (make_retrieval, "queries.jsonl", '{"_id": "q1", "text": "x"}\n{"_id": "q2", "text": 5}\n',
     ["queries.jsonl", "line 2", "'text'", "string"]),
    (make_retrieval, "queries.jsonl", '{"_id": "q1", "text": "x"}\n{"_id": "q2", "text": "y"\n',
     ["queries.jsonl", "line 2", "not valid JSON"]),
    (make_retrieval, "qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\thigh\n",
     ["test.tsv", "line 2", "'score'"]),
    (make_retrieval, "qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq9\td1\t1\n",
     ["test.tsv", "line 3", "'query-id'", "q9"]),
    (make_retrieval, "qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\tnope\t1\n",
     ["test.tsv", "line 2", "'corpus-id'"]),
    (make_retrieval, "qrels/test.tsv", "q1\td1\t1\n", ["test.tsv", "line 1", "header"]),
    (make_retrieval, "qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1 d1 1\n", ["test.tsv", "line 2", "3 tab"]),
    (make_classification, "train.jsonl", '{"text": "a", "label": "x"}\n{"text": "b"}\n',
     ["train.jsonl", "line 2", "'label'", "missing"]),
    (make_classification, "test.jsonl", '{"text": "a", "label": [1]}\n', ["test.jsonl", "line 1", "'label'"]),
    (make_classification, "test.jsonl", "\n\n", ["test.jsonl", "no records"]),
    (make_classification, "train.jsonl", '{"text": "a", "label": "x"}\n', ["train.jsonl", "'label'", "two distinct"]),
    (make_similarity, "pairs.jsonl",
     '{"text1": "a", "text2": "b", "score": 1}\n{"text1": "a", "text2": "b", "score": "5"}\n',
     ["pairs.jsonl", "line 2", "'score'", "number"]),
    (make_similarity, "pairs.jsonl", '[1, 2]\n', ["pairs.jsonl", "line 1", "JSON object"]),
    (make_similarity, "pairs.jsonl", '{"text1": "a", "score": 1}\n', ["pairs.jsonl", "line 1", "'text2'"]),
    (make_clustering, "clustering.jsonl", '{"text": "a", "label": true}\n', ["clustering.jsonl", "line 1", "'label'"]),
]


@pytest.mark.parametrize("maker, rel, content, fragments", MALFORMED,
                         ids=[f"{m[1]}-{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_files_name_file_line_and_field(tmp_path, maker, rel, content, fragments):
    root = maker(tmp_path / "task")
    _set(root, rel, content)
    with pytest.raises(DataError) as info:
        load_task_folder(root)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_missing_and_unknown_folders(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_task_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no task files"):
        load_task_folder(tmp_path / "empty")
    root = make_retrieval(tmp_path / "r")
    (root / "qrels" / "test.tsv").unlink()
    with pytest.raises(DataError, match="missing qrels/test.tsv"):
        load_task_folder(root)
    (root / "task.json").write_text('{"kind": "ranking"}')
    with pytest.raises(DataError, match="'kind'"):
        load_task_folder(root)

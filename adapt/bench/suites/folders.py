"""Benchmark tasks from local folders, in documented formats.

A folder holds one task; its kind comes from ``task.json`` (``{"kind": ..., "name": ...,
"description": ...}``, all optional) or else from the files present:

============== ===================================================================================
retrieval      BEIR layout: ``corpus.jsonl`` (``_id``, ``title``, ``text``), ``queries.jsonl``
               (``_id``, ``text``), ``qrels/test.tsv`` (header ``query-id corpus-id score``,
               tab-separated; score 0 means judged not relevant)
classification ``train.jsonl`` and ``test.jsonl``, one ``{"text": ..., "label": ...}`` per line
similarity     ``pairs.jsonl``, one ``{"text1": ..., "text2": ..., "score": <number>}`` per line
clustering     ``clustering.jsonl``, one ``{"text": ..., "label": ...}`` per line
============== ===================================================================================

Anything malformed raises :class:`adapt.errors.DataError` naming the file, the line and the field.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from adapt.bench.tasks import ClassificationTask, ClusteringTask, RetrievalTask, SimilarityTask, Task
from adapt.errors import DataError

LAYOUTS = {
    "retrieval": ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv"),
    "classification": ("train.jsonl", "test.jsonl"),
    "similarity": ("pairs.jsonl",),
    "clustering": ("clustering.jsonl",),
}


def is_task_folder(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / "task.json").exists()
                              or any((path / files[0]).exists() for files in LAYOUTS.values()))


def load_task_folder(path: str | Path) -> Task:
    """Read the task in folder ``path``; its name is ``task.json``'s ``name`` or the folder name."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"task folder {path} does not exist")
    meta = _read_task_json(path / "task.json") if (path / "task.json").exists() else {}
    kind = meta.get("kind") or _detect_kind(path)
    missing = [f for f in LAYOUTS[kind] if not (path / f).is_file()]
    if missing:
        raise DataError(f"{path}: a {kind} task folder needs {', '.join(LAYOUTS[kind])}; missing {', '.join(missing)}")
    name = meta.get("name") or path.resolve().name
    description = meta.get("description", f"local {kind} task {path}")
    return _LOADERS[kind](path, name, description)


def _read_task_json(file: Path) -> dict:
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{file}: expected a JSON object")
    if "kind" in meta and meta["kind"] not in LAYOUTS:
        raise DataError(f"{file}: field 'kind' is {meta['kind']!r}; expected one of {', '.join(LAYOUTS)}")
    for key in ("name", "description"):
        if key in meta and not isinstance(meta[key], str):
            raise DataError(f"{file}: field '{key}' must be a string")
    return meta


def _detect_kind(path: Path) -> str:
    found = [kind for kind, files in LAYOUTS.items() if (path / files[0]).exists()]
    if len(found) == 1:
        return found[0]
    layouts = "; ".join(f"{k}: {', '.join(v)}" for k, v in LAYOUTS.items())
    if not found:
        raise DataError(f"{path}: no task files found. Expected one layout ({layouts})")
    raise DataError(f"{path}: files of several task kinds ({', '.join(found)}); add a task.json with a 'kind' field")


def read_jsonl(file: Path, fields: dict[str, str]) -> list[tuple[int, dict]]:
    """Records of ``file`` with their line numbers; ``fields`` maps a required field to
    ``"text"`` (a string), ``"id"`` or ``"label"`` (a string or an integer, returned as a string)
    or ``"number"`` (a finite int or float)."""
    out = []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not UTF-8 text ({e})") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file} line {lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{file} line {lineno}: expected a JSON object, got {type(record).__name__}")
        for name, kind in fields.items():
            record[name] = _check_field(file, lineno, record, name, kind)
        out.append((lineno, record))
    if not out:
        raise DataError(f"{file}: no records")
    return out


def _check_field(file: Path, lineno: int, record: dict, name: str, kind: str):
    where = f"{file} line {lineno}: field '{name}'"
    if name not in record:
        raise DataError(f"{where} is missing")
    value = record[name]
    if kind == "text":
        if not isinstance(value, str):
            raise DataError(f"{where} must be a string, got {type(value).__name__}")
        return value
    if kind in ("id", "label"):
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
            raise DataError(f"{where} must be a non-empty string or an integer, got {value!r}")
        return str(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _unique_ids(file: Path, records: list[tuple[int, dict]]) -> None:
    seen: dict[str, int] = {}
    for lineno, rec in records:
        if rec["_id"] in seen:
            raise DataError(f"{file} line {lineno}: field '_id' {rec['_id']!r} repeats line {seen[rec['_id']]}")
        seen[rec["_id"]] = lineno


def _load_retrieval(path: Path, name: str, description: str) -> RetrievalTask:
    corpus = read_jsonl(path / "corpus.jsonl", {"_id": "id", "text": "text"})
    queries = read_jsonl(path / "queries.jsonl", {"_id": "id", "text": "text"})
    _unique_ids(path / "corpus.jsonl", corpus)
    _unique_ids(path / "queries.jsonl", queries)
    for lineno, rec in corpus:
        title = rec.get("title", "")
        if not isinstance(title, str):
            raise DataError(f"{path / 'corpus.jsonl'} line {lineno}: field 'title' must be a string")
    doc_ids = {rec["_id"] for _, rec in corpus}
    query_ids = {rec["_id"] for _, rec in queries}
    qrels = _read_qrels(path / "qrels" / "test.tsv", query_ids, doc_ids)
    return RetrievalTask(
        name=name, description=description,
        query_ids=[r["_id"] for _, r in queries], queries=[r["text"] for _, r in queries],
        corpus_ids=[r["_id"] for _, r in corpus],
        corpus=[f"{r.get('title', '')} {r['text']}".strip() for _, r in corpus], qrels=qrels)


def _read_qrels(file: Path, query_ids: set[str], doc_ids: set[str]) -> dict[str, dict[str, float]]:
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not UTF-8 text ({e})") from None
    header = lines[0].split("\t") if lines else []
    if [h.strip() for h in header] != ["query-id", "corpus-id", "score"]:
        raise DataError(f"{file} line 1: expected the header 'query-id<TAB>corpus-id<TAB>score', got {lines[:1]}")
    qrels: dict[str, dict[str, float]] = {}
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split("\t")]
        if len(parts) != 3:
            raise DataError(f"{file} line {lineno}: expected 3 tab-separated fields, got {len(parts)}")
        qid, did, score = parts
        if qid not in query_ids:
            raise DataError(f"{file} line {lineno}: field 'query-id' {qid!r} is not in queries.jsonl")
        if did not in doc_ids:
            raise DataError(f"{file} line {lineno}: field 'corpus-id' {did!r} is not in corpus.jsonl")
        try:
            value = float(score)
        except ValueError:
            raise DataError(f"{file} line {lineno}: field 'score' must be a number, got {score!r}") from None
        if not math.isfinite(value):
            raise DataError(f"{file} line {lineno}: field 'score' must be finite, got {score!r}")
        qrels.setdefault(qid, {})[did] = value
    if not any(r > 0 for judged in qrels.values() for r in judged.values()):
        raise DataError(f"{file}: no judgement with a score above 0")
    return qrels


def _load_classification(path: Path, name: str, description: str) -> ClassificationTask:
    fields = {"text": "text", "label": "label"}
    train = [r for _, r in read_jsonl(path / "train.jsonl", fields)]
    test = [r for _, r in read_jsonl(path / "test.jsonl", fields)]
    if len({r["label"] for r in train}) < 2:
        raise DataError(f"{path / 'train.jsonl'}: field 'label' needs at least two distinct values")
    return ClassificationTask(name=name, description=description,
                              train_texts=[r["text"] for r in train], train_labels=[r["label"] for r in train],
                              test_texts=[r["text"] for r in test], test_labels=[r["label"] for r in test])


def _load_similarity(path: Path, name: str, description: str) -> SimilarityTask:
    rows = [r for _, r in read_jsonl(path / "pairs.jsonl", {"text1": "text", "text2": "text", "score": "number"})]
    return SimilarityTask.from_pairs(name, [(r["text1"], r["text2"]) for r in rows], [r["score"] for r in rows],
                                     description=description)


def _load_clustering(path: Path, name: str, description: str) -> ClusteringTask:
    rows = [r for _, r in read_jsonl(path / "clustering.jsonl", {"text": "text", "label": "label"})]
    if len({r["label"] for r in rows}) < 2:
        raise DataError(f"{path / 'clustering.jsonl'}: field 'label' needs at least two distinct values")
    return ClusteringTask(name=name, description=description,
                          texts=[r["text"] for r in rows], labels=[r["label"] for r in rows])


_LOADERS = {"retrieval": _load_retrieval, "classification": _load_classification,
            "similarity": _load_similarity, "clustering": _load_clustering}

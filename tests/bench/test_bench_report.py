"""BM25 on a tiny retrieval task, the reference rows of --baselines, and the report's intervals and markers."""
from __future__ import annotations

import json

import numpy as np
import pytest

from adapt.bench import RetrievalTask, SimilarityTask, run_bench
from adapt.bench.bm25 import BM25Baseline, bm25_ranking
from adapt.bench.models import REFERENCE_LABEL, ModelSpec
from adapt.bench.report import markdown
from adapt.bench.runner import expand_models
from adapt.bench.tasks import ClassificationTask
from tests.bench.test_bench_fakes import HashEncoder

DOCS = {"cat": "the cat purrs and sleeps on the warm mat", "dog": "a loyal dog barks at the mail carrier",
        "py": "python is a programming language with dynamic typing", "sea": "waves of the sea crash on rocks",
        "sun": "the sun is a star at the centre of the solar system"}
QUERIES = {"q-cat": "where does the cat sleep", "q-dog": "dog barking", "q-py": "programming language typing",
           "q-none": "zebra quantum violin"}


def tiny_retrieval(name: str = "tiny-retrieval") -> RetrievalTask:
    qrels = {q: {q[2:]: 1.0} for q in QUERIES if q != "q-none"} | {"q-none": {"sea": 1.0}}
    return RetrievalTask(name=name, query_ids=list(QUERIES), queries=list(QUERIES.values()), corpus_ids=list(DOCS),
                         corpus=list(DOCS.values()), qrels=qrels)


def test_bm25_ranks_the_matching_document_first_and_retrieves_nothing_without_a_shared_word():
    top = bm25_ranking(list(QUERIES.values()), list(DOCS.values()), k=3)
    ids = list(DOCS)
    assert [ids[row[0]] for row in top[:3]] == ["cat", "dog", "py"]
    assert (top[3] == -1).all()  # no query word in the corpus: nothing retrieved, not an arbitrary order
    scores, items = BM25Baseline().evaluate(tiny_retrieval())
    assert scores["ndcg@10"] == pytest.approx(0.75) and scores["mrr@10"] == pytest.approx(0.75)
    assert items.statistic == "mean" and items.values.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert BM25Baseline().evaluate(ClassificationTask(name="c", train_texts=["a"], train_labels=["x"],
                                                      test_texts=["b"], test_labels=["x"])) is None


def test_references_come_after_the_models_and_decoder_baselines(monkeypatch):
    monkeypatch.setattr("adapt.bench.models.reference_spec", lambda: ModelSpec("/minilm", label=REFERENCE_LABEL))
    entries = expand_models(["m"], baselines=True, source="org/dec", references=True)
    assert [s.label if s else type(e).__name__ for s, e in entries][-2:] == [REFERENCE_LABEL, "BM25Baseline"]
    assert len(entries) == 7  # the model, four decoder baselines (one after a sink prompt), MiniLM, BM25
    # a model that is not a converted run: no decoder baselines, the references still come
    entries = expand_models(["plain"], baselines=True, source=None, references=True)
    assert [s.source if s else "bm25" for s, _ in entries] == ["plain", "/minilm", "bm25"]


def _similarity() -> SimilarityTask:
    words = [("cat", "kitten", 9.0), ("cat", "car", 1.0), ("dog", "puppy", 8.5), ("sun", "star", 6.0),
             ("sea", "ocean", 9.5), ("tree", "house", 0.5), ("python", "snake", 7.0), ("mat", "rug", 8.0)]
    return SimilarityTask.from_pairs("tiny-sim", [(a, b) for a, b, _ in words], [s for *_, s in words])


def test_report_shows_intervals_markers_and_not_applicable_cells(tmp_path, monkeypatch):
    monkeypatch.setattr("adapt.bench.models.reference_spec", lambda: ModelSpec("/minilm", label=REFERENCE_LABEL))

    def loader(spec, max_length):
        return HashEncoder(spec.display, dim=4 if spec.label == REFERENCE_LABEL else 256)

    report = run_bench([HashEncoder("bow", dim=256)], tasks=[tiny_retrieval(), _similarity()], out_dir=tmp_path,
                       references=True, loader=loader, show_progress=False, update_cards=False)
    rows = json.loads((tmp_path / "results.json").read_text())
    assert {r["model"] for r in rows} == {"bow", REFERENCE_LABEL, "BM25"}
    main = [r for r in rows if r["main"]]
    assert all(r["ci_low"] <= r["value"] <= r["ci_high"] and r["reference"] == "bow" for r in main)
    assert not any(r["task"] == "tiny-sim" and r["model"] == "BM25" for r in rows)
    averages = {r["model"]: r for r in rows if r["kind"] == "average"}
    assert set(averages) == {"bow", REFERENCE_LABEL}  # BM25 has no similarity score: no average
    md = report.markdown
    bm25_line = next(line for line in md.splitlines() if line.startswith("| tiny-sim"))
    assert bm25_line.rstrip().endswith("| - |")
    avg_line = next(line for line in md.splitlines() if line.startswith("| **average**"))
    assert avg_line.rstrip().endswith("| - |") and "95% interval" in md and "Against **bow**" in md
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


def _row(model, task, value, low, high, significant=None, delta=None, main=True, kind="retrieval"):
    return {"model": model, "task": task, "kind": kind, "metric": "ndcg@10" if main else "average", "value": value,
            "main": main, "ci_low": low, "ci_high": high, "significant": significant, "delta": delta,
            "reference": "base", "p_value": None if significant is None else (0.01 if significant else 0.4)}


def test_markdown_cells_and_legend():
    rows = [_row("base", "t", 0.552, 0.531, 0.573), _row("up", "t", 0.61, 0.58, 0.64, True, 0.058),
            _row("down", "t", 0.40, 0.37, 0.43, True, -0.152), _row("same", "t", 0.55, 0.52, 0.58, False, -0.002),
            _row("base", "average", 0.552, 0.531, 0.573, main=False, kind="average"),
            _row("up", "average", 0.61, 0.58, 0.64, True, 0.058, main=False, kind="average")]
    md = markdown(rows, "x")
    line = next(line for line in md.splitlines() if line.startswith("| t |"))
    assert line == ("| t | ndcg@10 | 0.552 [0.53, 0.57] | 0.610 [0.58, 0.64]* | 0.400 [0.37, 0.43]† "
                    "| 0.550 [0.52, 0.58] |")
    avg = next(line for line in md.splitlines() if line.startswith("| **average**"))
    # a model without an average row (it misses a task of the run) gets none
    assert avg == "| **average** | | 0.552 [0.53, 0.57] | 0.610 [0.58, 0.64]* | - | - |"
    assert "`*` significantly higher, `†` significantly lower" in md and "**base**" in md


def test_markdown_without_intervals_keeps_the_plain_table():
    rows = [{"model": m, "task": t, "metric": "accuracy", "value": v, "main": True}
            for m, t, v in (("a", "x", 0.5), ("a", "y", 0.7), ("b", "x", 0.6))]
    md = markdown(rows)
    assert "| x | accuracy | 0.500 | 0.600 |" in md and "| **average** | | 0.600 | - |" in md
    assert "interval" not in md and np.isfinite(0.6)

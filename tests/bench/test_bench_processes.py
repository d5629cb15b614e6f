"""``adapt bench`` over two processes (torchrun, gloo on the CPU) scores what one process scores.

Each process encodes its share of every task's texts; process 0 gathers them, scores, writes the
reports, the embedding cache and the model cards. The vectors are the same bit for bit (the same
encode calls on the same blocks of texts), so the scores are too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adapt.bench import run_bench
from adapt.bench.report import read_results
from adapt.model.bidirectional import make_bidirectional
from adapt.export.dense import export_encoder
from tests.bench.test_bench_folders import write_jsonl
from tests.tiny import CORPUS, tiny_decoder, tiny_tokenizer
from tests.procs import failure

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("llama", "qwen2")
WORDS = CORPUS.split()


def _text(i: int, n: int) -> str:
    return " ".join(WORDS[(7 * i) % (len(WORDS) - n):][:n])


def _tasks(root: Path) -> list[Path]:
    """Retrieval, classification and similarity folders with texts of many lengths (several blocks each),
    and the similarity task again under another name (its texts come from the cache)."""
    ret = root / "ret"
    docs = [{"_id": f"d{i}", "text": _text(i, 5 + i % 17)} for i in range(30)]
    write_jsonl(ret / "corpus.jsonl", docs)
    write_jsonl(ret / "queries.jsonl", [{"_id": f"q{i}", "text": _text(3 * i, 3 + i % 4)} for i in range(9)])
    (ret / "qrels").mkdir()
    (ret / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\td{(3 * i + j) % 30}\t1\n" for i in range(9) for j in range(2)))
    cls = root / "cls"
    write_jsonl(cls / "train.jsonl", [{"text": _text(i, 4 + i % 9), "label": i % 3} for i in range(24)])
    write_jsonl(cls / "test.jsonl", [{"text": _text(50 + i, 4 + i % 7), "label": i % 3} for i in range(12)])
    sim = root / "sim"
    write_jsonl(sim / "pairs.jsonl", [{"text1": _text(i, 3 + i % 8), "text2": _text(i + 5, 2 + i % 11),
                                       "score": float((i * 37) % 11)} for i in range(20)])
    again = root / "sim-again"
    again.mkdir()
    (again / "pairs.jsonl").write_text((sim / "pairs.jsonl").read_text())
    (again / "task.json").write_text(json.dumps({"kind": "similarity", "name": "sim-again"}))
    return [ret, cls, sim, again]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench2")
    tok = tiny_tokenizer()
    encoders = [export_encoder(make_bidirectional(tiny_decoder(family, vocab_size=len(tok))), tok,
                               root / family, max_seq_length=24) for family in FAMILIES]
    return root, encoders, _tasks(root / "tasks")


def _mains(rows) -> dict:
    return {(r["model"], r["task"]): r["value"] for r in rows if r["main"] and r["kind"] != "average"}


def test_two_processes_score_what_one_scores(setup, free_port):
    root, encoders, tasks = setup
    two = root / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", free_port, "-m", "adapt", "bench", *map(str, encoders),
           *[arg for t in tasks for arg in ("--task", str(t))], "-o", str(two), "--batch-size", "4", "--quiet"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, failure(run.stderr)
    assert run.stdout.count("| task | metric |") == 1  # process 0 alone prints the report

    one = root / "one"
    report = run_bench([str(e) for e in encoders], tasks=[str(t) for t in tasks], out_dir=one, batch_size=4,
                       show_progress=False, update_cards=False)
    assert report.cache_hits == len(encoders)  # sim-again: the pairs' texts were embedded for sim
    expected = _mains(report.rows)
    got = _mains(read_results(two / "results.json"))
    assert set(got) == set(expected) and len(got) == len(encoders) * len(tasks)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key
    assert len({round(v, 6) for v in expected.values()}) > 2  # the tasks and models do score differently

    # one cache, written by process 0 alone, holding the very vectors one process computes
    cached = sorted(p.relative_to(two / "cache") for p in (two / "cache").rglob("*") if p.is_file())
    assert cached == sorted(p.relative_to(one / "cache") for p in (one / "cache").rglob("*") if p.is_file())
    assert len(cached) == len(encoders) * 4  # queries, corpus, classification (train + test), pairs texts
    for rel in cached:
        assert np.array_equal(np.load(two / "cache" / rel), np.load(one / "cache" / rel)), rel
    # the model cards got process 0's scores
    for enc in encoders:
        card = (enc / "README.md").read_text()
        for task, kind, metric in (("ret", "retrieval", "ndcg@10"), ("sim-again", "similarity", "spearman")):
            assert f"| {task} | {kind} | {metric} | {expected[(enc.name, task)]:.3f}" in card


def test_mteb_tasks_over_two_processes_score_what_one_scores(setup, free_port):
    """mteb's own evaluation under torchrun: every process encodes its share and runs mteb's scoring on the
    gathered vectors; process 0's scores are reported, and they equal one process's."""
    pytest.importorskip("mteb")
    root, encoders, _ = setup
    tasks = ["MockRetrievalTask", "MockSTSTask", "MockClassificationTask"]
    two = root / "mteb-two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", free_port, "-m", "adapt", "bench", str(encoders[0]),
           *[arg for t in tasks for arg in ("--task", t)], "-o", str(two), "--batch-size", "4", "--quiet", "--no-card"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, failure(run.stderr)
    assert run.stdout.count("| task | metric |") == 1
    one = run_bench([str(encoders[0])], tasks=tasks, out_dir=root / "mteb-one", batch_size=4, show_progress=False,
                    update_cards=False)
    expected, got = _mains(one.rows), _mains(read_results(two / "results.json"))
    assert set(got) == set(expected) and len(got) == len(tasks)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key

"""The MTEB path with mteb's offline mock tasks; offline failures become a clear DataError.

Importing mteb (and the sentence-transformers it pulls in) takes several seconds, so everything
here shares one module-scoped run.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mteb")

from adapt.bench import run_bench  # noqa: E402
from adapt.bench.suites import mteb as mteb_tasks  # noqa: E402
from adapt.errors import DataError  # noqa: E402
from tests.bench.test_bench_fakes import HashEncoder, PromptedHashEncoder  # noqa: E402

TASKS = ["MockRetrievalTask", "MockSTSTask", "mteb:MockClassificationTask"]


@pytest.fixture(scope="module")
def mock_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mteb")
    enc = HashEncoder("bow")
    report = run_bench([enc], tasks=TASKS, out_dir=out, show_progress=False)
    return out, enc, report


def test_mock_tasks_scored_by_mteb(mock_run):
    _, enc, report = mock_run
    kinds = {r["task"]: r["kind"] for r in report.rows}
    assert kinds == {"MockRetrievalTask": "retrieval", "MockSTSTask": "similarity",
                     "MockClassificationTask": "classification"}
    mains = {r["task"]: (r["metric"], r["value"]) for r in report.rows if r["main"]}
    assert mains["MockRetrievalTask"][0] == "ndcg@10" and mains["MockSTSTask"][0] == "spearman"
    assert mains["MockClassificationTask"][0] == "accuracy"
    assert {r["metric"] for r in report.rows if r["task"] == "MockRetrievalTask"} == {"ndcg@10", "mrr@10", "recall@100"}
    assert all(0 <= r["value"] <= 1 for r in report.rows if r["kind"] != "similarity")
    assert enc.calls >= 4 and all(r["n"] for r in report.rows)


def test_mteb_sts_matches_our_cosine_spearman(mock_run):
    _, _, report = mock_run
    from mteb.mocks.mock_tasks.sts import MockSTSTask

    task = MockSTSTask()
    task.load_data()
    data = task.dataset["test"]
    from adapt.bench.metrics import similarity_scores

    enc = HashEncoder("bow")
    ours = similarity_scores(enc.encode(list(data["sentence1"])), enc.encode(list(data["sentence2"])),
                             list(data["score"]))["spearman"]
    assert report.value("bow", "MockSTSTask") == pytest.approx(ours)


def test_mteb_embeddings_are_cached(mock_run):
    out, _, _ = mock_run
    again = HashEncoder("bow")
    run_bench([again], tasks=TASKS, out_dir=out, show_progress=False)
    assert again.calls == 0


def test_adapter_passes_query_and_document_prompts():
    seen = []

    def embed_fn(texts, prompt):
        seen.append(prompt)
        return PromptedHashEncoder().encode(texts)

    task = mteb_tasks.get_task("MockRetrievalTask")
    values, main, _ = mteb_tasks.evaluate(task, embed_fn, model_name="p", prompts=PromptedHashEncoder.prompts)
    assert main == "ndcg@10" and set(values) == {"ndcg@10", "mrr@10", "recall@100"}
    assert set(seen) == {"query", "document"}


def test_offline_download_failure_says_what_to_do():
    from mteb.mocks.mock_tasks.sts import MockSTSTask

    class OfflineTask(MockSTSTask):
        def load_data(self, num_proc=None, **kwargs):
            try:
                raise FileNotFoundError("not in the local cache")
            except FileNotFoundError as e:
                raise ConnectionError("Couldn't reach 'mteb/stsbenchmark' on the Hub (OfflineModeIsEnabled)") from e

    with pytest.raises(DataError, match="needs its data from the Hugging Face Hub.*--suite quick"):
        mteb_tasks.evaluate(OfflineTask(), lambda texts, prompt: np.ones((len(texts), 2)), model_name="m")


def test_other_errors_are_not_disguised():
    from mteb.mocks.mock_tasks.sts import MockSTSTask

    def broken(texts, prompt):
        raise RuntimeError("encoder bug")

    with pytest.raises(RuntimeError, match="encoder bug"):
        mteb_tasks.evaluate(MockSTSTask(), broken, model_name="m")


def test_unknown_task_name(tmp_path):
    with pytest.raises(DataError, match="unknown task .NoSuchTask.*Tasks of the offline suites: quick: lee-similarity"):
        run_bench([HashEncoder()], tasks=["NoSuchTask"], out_dir=tmp_path)
    with pytest.raises(DataError, match="no mock task"):
        mteb_tasks.get_task("MockNothing")


def test_mteb_lite_tasks_resolve_offline():
    from adapt.bench import list_suites

    for name in list_suites()["mteb-lite"]:
        task = mteb_tasks.get_task(name)
        assert mteb_tasks.task_kind(task) in ("retrieval", "classification", "similarity")

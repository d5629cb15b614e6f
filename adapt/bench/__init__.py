"""Benchmarks for ``adapt bench``: tasks, metrics, the embedding cache and reports.

Entry points: :func:`run_bench` (score models, write results.json/.md/.png) and
:func:`list_suites`. Modules: ``metrics`` (pure numpy scores), ``tasks`` (in-memory tasks),
``quick`` (the small offline suite), ``standard`` (the offline suite with dev/test splits: tasks in
``std_wordnet``, ``std_reference``, ``std_text``, packaged data located by ``sources``),
``folders`` (user task folders), ``mteb_tasks`` (MTEB by name), ``models`` (model specs,
baselines, references), ``bm25`` (the BM25 baseline), ``sparse`` (SPLADE encoders on retrieval), ``stats``
(bootstrap intervals, paired tests), ``cache`` (embeddings), ``dims`` (each model at several embedding sizes),
``report``, ``runner``. How to use them: ``adapt/bench/README.md``.
"""
from adapt.bench.models import ModelSpec, baseline_specs
from adapt.bench.report import BenchReport
from adapt.bench.runner import SUITE_HELP, SUITES, list_suites, resolve_task, run_bench
from adapt.bench.tasks import ClassificationTask, ClusteringTask, RetrievalTask, SimilarityTask, Task

__all__ = ["run_bench", "list_suites", "resolve_task", "ModelSpec", "baseline_specs", "BenchReport", "SUITES",
           "SUITE_HELP", "Task", "RetrievalTask", "ClassificationTask", "SimilarityTask", "ClusteringTask"]

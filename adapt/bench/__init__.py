"""Benchmarks for ``adapt bench``: tasks, metrics, the embedding cache and reports.

Entry points: :func:`run_bench` (score models, write results.json/.md/.png) and
:func:`list_suites`. Modules: ``metrics`` (pure numpy scores), ``tasks`` (in-memory tasks),
``suites/`` (one module per task family behind a registry: ``quick``, the small offline suite;
``standard``, the offline suite with dev/test splits, built by ``standard_wordnet``, ``standard_reference``,
``standard_text`` from packaged data that ``package_data`` locates; ``mteb``, MTEB by name; ``folders``,
user task folders), ``models`` (model specs,
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

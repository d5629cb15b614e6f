"""MTEB tasks by name, scored by mteb's own evaluation (needs the ``mteb`` package and, except for
its offline mock tasks, a network to download the task data from the Hugging Face Hub).

Our encoder is made to look like an mteb 2.x encoder by :class:`MtebEncoderAdapter`: mteb calls
``encode(DataLoader of batches, task_metadata=..., hf_split=..., hf_subset=..., prompt_type=...)``,
each batch a dict whose ``"text"`` list holds the texts (for corpora, title and body already joined).
Embeddings go through the same cache as the built-in tasks.

This module imports mteb at import time (several seconds): the runner imports it only when an mteb
task is asked for.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from adapt.errors import DataError

try:
    import mteb
    from mteb.models.abs_encoder import AbsEncoder
    from mteb.models.model_meta import ModelMeta, ScoringFunction
except ImportError as e:  # pragma: no cover - mteb is a dependency, but say what to do if it is gone
    raise DataError(f"MTEB tasks need the mteb package ({e}): pip install 'mteb>=2'") from None

MTEB_LITE = ["SciFact", "NFCorpus", "ArguAna", "Banking77Classification", "EmotionClassification", "STSBenchmark"]
MTEB_MOCK = ["MockRetrievalTask", "MockClassificationTask", "MockSTSTask", "MockClusteringTask"]
RANK = 9  # last in `adapt bench --help`; its tasks are resolved by name through mteb (adapt.bench.runner)
SUITES = {"mteb-lite": ("6 MTEB tasks scored by mteb (needs a network to download them)", MTEB_LITE),
          "mteb-mock": ("mteb's tiny offline mock tasks: checks the MTEB path, scores mean nothing", MTEB_MOCK)}

KINDS = {"Retrieval": "retrieval", "Classification": "classification", "STS": "similarity",
         "Clustering": "clustering", "Reranking": "retrieval"}
# mteb score name -> our metric name; the task's main score is always reported as well
METRICS = {"ndcg_at_10": "ndcg@10", "mrr_at_10": "mrr@10", "recall_at_100": "recall@100", "accuracy": "accuracy",
           "f1": "macro_f1", "cosine_spearman": "spearman", "v_measure": "v_measure"}
WANTED = {"retrieval": ["ndcg_at_10", "mrr_at_10", "recall_at_100"], "classification": ["accuracy", "f1"],
          "similarity": ["cosine_spearman"], "clustering": ["v_measure"]}

EmbedFn = Callable[[list[str], str | None], np.ndarray]


def get_task(name: str):
    """The mteb task object called ``name`` (an mteb registry name or one of its offline mock tasks)."""
    if name.startswith("Mock"):
        from mteb import mocks
        from mteb.mocks import mock_tasks

        cls = getattr(mocks, name, None) or getattr(mock_tasks, name, None)
        if cls is None:
            raise DataError(f"mteb has no mock task {name!r}")
        return cls()
    try:
        found = mteb.get_tasks(tasks=[name])
    except KeyError:
        found = []
    if not found:
        raise DataError(f"unknown task {name!r}: not a quick-suite task, not a task folder, not an MTEB task name")
    return found[0]


def task_kind(task) -> str:
    return KINDS.get(task.metadata.type, task.metadata.type.lower())


class MtebEncoderAdapter(AbsEncoder):
    """An mteb encoder whose ``encode`` collects the texts of mteb's DataLoader and calls ``embed_fn``."""

    def __init__(self, embed_fn: EmbedFn, name: str, revision: str = "local", prompts: dict | None = None):
        self.embed_fn = embed_fn
        self.texts_seen = 0
        self.model_prompts = dict(prompts) if prompts else None
        self.mteb_model_meta = ModelMeta.create_empty({
            "name": f"adapt-bench/{name}", "revision": revision,
            "similarity_fn_name": ScoringFunction.COSINE, "modalities": ["text"]})

    def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kwargs) -> np.ndarray:
        texts = [text for batch in inputs for text in batch["text"]]
        self.texts_seen += len(texts)
        # mteb's own choice among the encoder's prompts (task name, task type, then query/document)
        prompt = self.get_prompt_name(task_metadata, prompt_type) if self.model_prompts else None
        return self.embed_fn(texts, prompt)


def _is_offline_error(exc: BaseException) -> bool:
    names = {"ConnectionError", "OfflineModeIsEnabled", "DatasetNotFoundError", "LocalEntryNotFoundError",
             "ConnectTimeout", "ReadTimeout", "MaxRetryError", "NameResolutionError", "HfHubHTTPError"}
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ in names for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def evaluate(task, embed_fn: EmbedFn, *, model_name: str, revision: str = "local", batch_size: int = 32,
             prompts: dict | None = None) -> tuple[dict[str, float], str, int | None]:
    """Run mteb's evaluation of ``task``: (our metric name -> value, main metric name, n).

    ``embed_fn(texts, prompt_name)`` embeds; ``prompts`` are the encoder's named prompts, if any.
    """
    adapter = MtebEncoderAdapter(embed_fn, model_name, revision, prompts)
    name = task.metadata.name
    try:
        with warnings.catch_warnings():  # tiny or skewed splits make sklearn warn about ill-defined F1
            warnings.filterwarnings("ignore", message=".*ill-defined.*")
            result = mteb.evaluate(adapter, tasks=[task], cache=None, show_progress_bar=False,
                                   encode_kwargs={"batch_size": batch_size, "show_progress_bar": False})
    except Exception as e:
        if _is_offline_error(e):
            raise DataError(f"MTEB task {name} needs its data from the Hugging Face Hub, which could not be reached "
                            f"({type(e).__name__}: {str(e)[:200]}). Run with a network connection, or use the "
                            "offline suite: --suite quick") from None
        raise
    task_result = result.task_results[0]
    split = task.metadata.eval_splits[0]
    subsets = task_result.scores.get(split) or next(iter(task_result.scores.values()))
    main = task.metadata.main_score
    keys = list(dict.fromkeys(WANTED.get(task_kind(task), []) + [main]))
    values = {}
    for key in keys:
        scores = [s[key] for s in subsets if isinstance(s.get(key), (int, float))]
        if scores:
            values[METRICS.get(key, key)] = float(np.mean(scores))
    stats = getattr(task.metadata, "descriptive_stats", None) or {}
    n = (stats.get(split) or {}).get("num_samples") or adapter.texts_seen or None
    return values, METRICS.get(main, main), n

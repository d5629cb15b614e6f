"""Fine-tuned evaluation (``adapt bench --suite finetune`` / ``finetune-dev``): each model fine-tuned on each
task's training examples by the library's own code, for the same fixed budget and several seeds, then scored
on the task's held-out items.

The models: those given (an adapt encoder or run folder, a decoder folder, a hub id), and with
``baselines`` their source decoder twice - as transformers' own ``*ForSequenceClassification`` runs it
(causal attention, the last token's state), and made bidirectional without training - then with
``references`` all-MiniLM-L6-v2. A GGUF source is dequantized once into a float32 folder under
``out_dir/sources`` (transformers fine-tunes a folder). Every (model, task, seed) is fitted by
:func:`adapt.pipeline.classifiers.fit_classifier` with :data:`adapt.bench.suites.finetune.BUDGET` (or the
arguments), its predictions written to ``out_dir/finetune/`` as soon as they exist: a rerun after a crash
fits only what is missing. The report (``results.json``/``.md``/``.png``, as every suite) gives accuracy
(the main metric) and macro-F1 with 95% intervals over items and seeds (:mod:`adapt.bench.stats`), the
average over tasks, and the paired verdict of each model against the source decoder's causal classifier.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from adapt.bench import stats
from adapt.bench.models import ModelSpec, as_spec, find_source, reference_spec
from adapt.bench.report import BenchReport, markdown, versions, write_reports
from adapt.bench.tasks import FinetuneTask
from adapt.errors import ConfigError
from adapt.files import atomic_path, atomic_write_json, atomic_write_text

CAUSAL, UNTRAINED = "causal classifier", "bidirectional, untrained"


def finetune_entries(models: list, *, baselines: bool, references: bool, source: str | None) -> list[ModelSpec]:
    """The models in report order: each given one, then (``baselines``) its source decoder as a causal
    classifier and bidirectional untrained, then (``references``) all-MiniLM-L6-v2; deduplicated."""
    out: dict[str, ModelSpec] = {}
    for model in models:
        spec = as_spec(model)
        out.setdefault(spec.canonical(), spec)
        if baselines:
            src = source or find_source(spec.source)
            if not src:
                raise ConfigError(f"--baselines needs a converted model (a folder with run/config.yaml naming "
                                  f"model.source); {spec.source} has none. Pass --source DECODER.")
            name = Path(src.rstrip("/")).name or src
            for b in (ModelSpec(src, bidirectional=False, label=f"{name} ({CAUSAL})"),
                      ModelSpec(src, bidirectional=True, label=f"{name} ({UNTRAINED})")):
                out.setdefault(b.canonical(), b)
    if references:
        minilm = reference_spec()
        if minilm is not None:
            out.setdefault(minilm.canonical(), minilm)
    if not out:
        raise ConfigError("no model to benchmark")
    return list(out.values())


def trainable_folder(source: str, work: Path) -> str:
    """A folder or hub id transformers fine-tunes: an adapt encoder's Transformer folder, a model folder, a
    hub id, or a GGUF file dequantized once into ``work/sources/NAME`` (float32)."""
    from adapt.model.loading import looks_like_hub_id, resolve_source
    from adapt.model.quantization import dequantized_gguf
    from adapt.pipeline.finetune import base_model_dir

    path = Path(source).expanduser()
    if not path.exists() and looks_like_hub_id(source) and not source.startswith("py:"):
        return source
    resolved = resolve_source(source)
    if not resolved.gguf_file:
        return base_model_dir(resolved.path)
    target = work / "sources" / f"{Path(resolved.gguf_file).stem}-{_digest(resolved.path + resolved.gguf_file)}"
    if not (target / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = dequantized_gguf(AutoModelForCausalLM.from_pretrained(resolved.path, gguf_file=resolved.gguf_file,
                                                                      dtype=torch.float32))
        tokenizer = AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
        with atomic_path(target) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return str(target)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def _fit_and_predict(base: str, spec: ModelSpec, task: FinetuneTask, seed: int, budget: dict) -> dict:
    """One fit (its own bar off: the bench's bar counts fits) and its predictions on the task's scored items."""
    from adapt.pipeline.classifiers import fit_classifier, predict, unique_labels

    kind = task.examples
    labels = unique_labels(kind, task.train_labels, task.eval_labels)
    train = ([tuple(x) for x in task.train_examples] if kind == "pair" else task.train_examples, task.train_labels)
    start, cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="adapt-finetune-") as run_dir:
        fitted = fit_classifier(base, kind, train, labels, Path(run_dir), tuning=budget["tuning"],
                                lr=budget["lr"][budget["tuning"]], epochs=budget["epochs"],
                                batch_size=budget["batch_size"], max_length=budget["max_length"], seed=seed,
                                lora_r=budget["lora_r"], bidirectional=spec.bidirectional is not False,
                                show_progress=False)
    examples = [tuple(x) for x in task.eval_examples] if kind == "pair" else task.eval_examples
    predicted = predict(fitted, kind, examples, max_length=budget["max_length"])
    return {"labels": labels, "predicted": predicted, "seconds": round(time.perf_counter() - start, 2),
            "cpu_seconds": round(time.process_time() - cpu, 2),  # all threads: on an idle machine about threads x wall
            "train_loss": [h["train_loss"] for h in fitted.history]}


def _evidence(task: FinetuneTask, runs: list[dict]) -> tuple[dict, dict[str, stats.ItemScores]]:
    """Scores (averaged over seeds, with the seeds' spread) and the items x seeds evidence of each metric."""
    labels = runs[0]["labels"]
    index = {name: i for i, name in enumerate(labels)}
    flat = (lambda rows: [y for row in rows for y in row]) if task.examples == "token" else list  # noqa: E731
    gold = np.array([index[y] for y in flat(task.eval_labels)])
    preds = np.stack([[index[y] for y in flat(r["predicted"])] for r in runs], axis=1)
    table = np.concatenate([gold[:, None], preds], axis=1)
    items = {"accuracy": stats.ItemScores("accuracy_over_seeds", table),
             "macro_f1": stats.ItemScores("macro_f1_over_seeds", table)}
    per_seed = {m: [stats.ItemScores(items[m].statistic, table[:, [0, 1 + s]]).value() for s in range(len(runs))]
                for m in items}
    scores = {m: items[m].value() for m in items}
    scores.update({f"{m}_seed_std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for m, v in per_seed.items()})
    return scores, items


def run_finetune_bench(models: list, tasks: list[FinetuneTask], *, out_dir, baselines: bool = False,
                       references: bool | None = None, source: str | None = None, seeds: int | None = None,
                       budget: dict | None = None, reference: str | None = None, title: str = "adapt bench: finetune",
                       show_progress: bool = True) -> BenchReport:
    """Fine-tune and score every model on every task (see the module docstring); returns the report."""
    from tqdm.auto import tqdm

    from adapt.bench.suites.finetune import BUDGET

    budget = {**BUDGET, **(budget or {})}
    seeds = seeds or budget["seeds"]
    if seeds < 1:
        raise ConfigError(f"seeds must be at least 1, not {seeds}")
    if budget["tuning"] not in ("full", "lora"):
        raise ConfigError(f"the fine-tuning budget's tuning must be full or lora, not {budget['tuning']!r}")
    out_dir = Path(out_dir)
    entries = finetune_entries(models, baselines=baselines, source=source,
                               references=baselines if references is None else references)
    bases = {spec.canonical(): trainable_folder(spec.source, out_dir) for spec in entries}  # errors before any fit
    display = [spec.display for spec in entries]
    causal = [name for name in display if name.endswith(f"({CAUSAL})")]
    reference = reference or (causal[0] if causal else display[0])
    if reference not in display:
        raise ConfigError(f"reference {reference!r} is not one of the benchmarked models: {', '.join(display)}")
    settings = {k: budget[k] for k in ("tuning", "epochs", "batch_size", "max_length", "lora_r")} | {
        "lr": budget["lr"][budget["tuning"]]}
    rows, items, env = [], {}, versions()
    f1_rows, f1_items = [], {}
    bar = tqdm(total=len(entries) * len(tasks) * seeds, desc="fine-tune", unit="fit", disable=not show_progress)
    try:
        for spec, name in zip(entries, display):
            for task in tasks:
                runs = []
                for seed in range(seeds):
                    bar.set_postfix_str(f"{name}: {task.name} seed {seed}")
                    key = _digest(json.dumps([spec.canonical(), task.name, task.n, len(task.train_labels), settings]))
                    path = out_dir / "finetune" / key / f"seed-{seed}.json"
                    if path.is_file():
                        run = json.loads(path.read_text(encoding="utf-8"))
                    else:
                        run = _fit_and_predict(bases[spec.canonical()], spec, task, seed, budget)
                        atomic_write_json(path, {"model": spec.canonical(), "task": task.name, "seed": seed,
                                                 "settings": settings, **run})
                    runs.append(run)
                    bar.update(1)
                scores, evidence = _evidence(task, runs)
                seconds = round(sum(r["seconds"] for r in runs), 2)
                for metric, value in scores.items():
                    row = {"model": name, "task": task.name, "kind": task.kind, "metric": metric, "value": value,
                           "main": metric == "accuracy", "n": task.n, "seeds": seeds, "seconds": seconds,
                           "spec": spec.canonical(), "settings": settings, "versions": env}
                    rows.append(row)
                    if metric == "macro_f1":
                        f1_rows.append(dict(row, main=True))
                items[(name, task.name)], f1_items[(name, task.name)] = evidence["accuracy"], evidence["macro_f1"]
    finally:
        bar.close()
    names = [t.name for t in tasks]
    annotated = stats.annotate(rows, items, reference, names)
    f1_annotated = stats.annotate(f1_rows, f1_items, reference, names)
    f1 = {(r["model"], r["task"]): r for r in f1_annotated}
    for row in annotated:  # macro-F1 rows carry their own intervals and paired tests
        if row["metric"] == "macro_f1":
            row.update({k: v for k, v in f1[(row["model"], row["task"])].items() if k != "main"})
    annotated += [dict(r, metric="macro_f1", kind="average_macro_f1") for r in f1_annotated if r["task"] == "average"]
    report = write_reports(annotated, out_dir, title)
    report.items = items
    report.verdicts = [line for line in (_verdict(name, reference, annotated) for name in display) if line]
    report.markdown += ("\n" + markdown([r for r in f1_annotated], f"{title}: macro-F1") + "\n" +
                        _budget_line(settings, seeds) + "\n" + "".join(f"\n{line}" for line in report.verdicts) + "\n")
    atomic_write_text(report.paths["markdown"], report.markdown)
    return report


def _budget_line(settings: dict, seeds: int) -> str:
    return (f"Fine-tuned: {settings['tuning']} (r {settings['lora_r']}) at lr {settings['lr']:g}, {settings['epochs']} "
            f"epochs, batch {settings['batch_size']}, texts cut to {settings['max_length']} tokens, {seeds} seeds; "
            "intervals: 95% bootstrap over items and seeds; accuracy is the main metric.")


def _verdict(model: str, reference: str, rows: list[dict]) -> str | None:
    """``verdict (fine-tuned): MODEL vs REF: accuracy +0.031 [...] (p ...), macro-F1 ...`` from the averages."""
    found = {r["kind"]: r for r in rows if r["model"] == model and r["task"] == "average"}
    parts = []
    for kind, label in (("average", "accuracy"), ("average_macro_f1", "macro-F1")):
        r = found.get(kind)
        if r and r.get("delta") is not None:
            parts.append(f"{label} {r['delta']:+.3f} [{r['delta_ci_low']:+.3f}, {r['delta_ci_high']:+.3f}] "
                         f"(p {r['p_value']:.3f})")
    return f"verdict (fine-tuned): {model} vs {reference}: " + ", ".join(parts) if parts else None

"""Benchmark reports: ``results.json`` (one row per model, task and metric, plus one ``average``
row per model), ``results.md`` (main metric per task, models as columns, plus the average over tasks)
and ``results.png`` (bars per task with their intervals).

Main-metric rows carry a bootstrap 95% interval (``ci_low``, ``ci_high``) and, against the
reference model, a paired test (``p_value``, ``significant``): see ``adapt.bench.stats``. The
markdown writes ``0.552 [0.53, 0.57]*``: ``*`` significantly above the reference, ``†``
significantly below it, ``-`` not applicable (BM25 on a task that is not retrieval).
"""
from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from adapt.files import atomic_path, atomic_write_json, atomic_write_text

PACKAGES = ("adapt", "torch", "transformers", "sentence-transformers", "numpy", "scikit-learn", "mteb")


def versions() -> dict[str, str | None]:
    """Versions of Python and the packages that can change a score."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


@dataclass
class BenchReport:
    """What a benchmark run produced: ``rows`` as in results.json, the markdown table, file paths."""

    rows: list[dict]
    markdown: str
    paths: dict[str, Path] = field(default_factory=dict)
    cache_hits: int = 0  # text groups whose embeddings came from OUT/cache
    cache_misses: int = 0  # text groups that were encoded
    verdicts: list[str] = field(default_factory=list)  # one line per converted model vs its source (adapt.bench.verdict)
    # (model, task) -> its per-item evidence (adapt.bench.stats.ItemScores), for comparisons the report does not make
    items: dict = field(default_factory=dict, repr=False)

    def value(self, model: str, task: str, metric: str | None = None) -> float | None:
        """One score: the task's main metric unless ``metric`` is given."""
        for row in self.rows:
            if row["model"] == model and row["task"] == task and (row["metric"] == metric if metric else row["main"]):
                return row["value"]
        return None


def _ordered(rows: list[dict], key: str) -> list[str]:
    return list(dict.fromkeys(row[key] for row in rows))


def main_table(rows: list[dict]) -> tuple[list[str], list[str], dict[tuple[str, str], float]]:
    """(models, tasks, {(task, model): main metric value}) in first-seen order."""
    main = [row for row in rows if row.get("main")]
    values = {(row["task"], row["model"]): row["value"] for row in main}
    return _ordered(main, "model"), _ordered(main, "task"), values


def markdown(rows: list[dict], title: str = "Benchmark") -> str:
    """A markdown table: one line per task (its main metric), one column per model, then the average,
    each score with its interval and significance marker when the rows have them, then a legend."""
    models, tasks, _ = main_table(rows)
    cell = {(row["task"], row["model"]): row for row in rows if row.get("main")}
    average = {row["model"]: row for row in rows if row.get("kind") == "average"}
    metric_of = {row["task"]: row["metric"] for row in rows if row.get("main")}
    lines = [f"## {title}", "", "| task | metric | " + " | ".join(models) + " |",
             "|---|---|" + "---:|" * len(models)]
    for task in tasks:
        lines.append(f"| {task} | {metric_of[task]} | " + " | ".join(_cell(cell.get((task, m))) for m in models) + " |")
    averages = []
    for m in models:
        if m in average:
            averages.append(_cell(average[m]))
        else:  # no intervals at all (MTEB tasks): the plain mean when the model has every task
            scores = [cell[(t, m)]["value"] for t in tasks if (t, m) in cell]
            complete = scores and len(scores) == len(tasks) and not average
            averages.append(_fmt(sum(scores) / len(scores)) if complete else "-")
    lines.append("| **average** | | " + " | ".join(averages) + " |")  # no bold: it would swallow the `*` marker
    return "\n".join(lines) + "\n" + _legend(rows) + _sparse_table(rows)


def _sparse_table(rows: list[dict]) -> str:
    """Sparse encoders' retrieval scores next to how many terms their vectors hold (adapt.bench.sparse)."""
    value = {(row["model"], row["task"], row["metric"]): row["value"] for row in rows}
    pairs = [(row["model"], row["task"]) for row in rows if row["metric"] == "active_terms_query"]
    if not pairs:
        return ""
    lines = ["", "### Sparse encoders", "", "| model | task | ndcg@10 | active terms / query | active terms / document "
             "| index (MB) |", "|---|---|---:|---:|---:|---:|"]
    for model, task in pairs:
        cells = [value.get((model, task, m)) for m in ("ndcg@10", "active_terms_query", "active_terms_doc", "index_mb")]
        lines.append(f"| {model} | {task} | " + " | ".join("-" if c is None else f"{c:.3f}" if i == 0 else f"{c:.1f}"
                                                         for i, c in enumerate(cells)) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _short(value: float) -> str:
    text = f"{value:.2f}"
    return "0.00" if text == "-0.00" else text


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    text = _fmt(row["value"])
    if row.get("ci_low") is not None:
        text += f" [{_short(row['ci_low'])}, {_short(row['ci_high'])}]"
    if row.get("significant"):
        text += "*" if row["delta"] > 0 else "†"
    return text


def _legend(rows: list[dict]) -> str:
    with_ci = [row for row in rows if row.get("ci_low") is not None]
    if not with_ci:
        return ""
    reference = next((row.get("reference") for row in with_ci if row.get("reference")), None)
    text = ("\nScores: the task's main metric with its bootstrap 95% interval [low, high] "
            "(1,000 resamples of queries, test items, pairs or clustered items; `adapt.bench.stats`).")
    if reference:
        text += (f" Against **{reference}** (paired bootstrap, same resamples, p < 0.05): "
                 "`*` significantly higher, `†` significantly lower.")
    return text + " `-`: not applicable.\n"


def bar_chart(rows: list[dict], path: str | Path, title: str = "Benchmark") -> Path:
    """Grouped bars: one group per task (and the average), one bar per model, bootstrap intervals
    as error bars (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    models, tasks, _ = main_table(rows)
    cell = {(row["task"], row["model"]): row for row in rows if row.get("main")}
    cell.update({("average", row["model"]): row for row in rows if row.get("kind") == "average"})
    groups = tasks + (["average"] if any(row.get("kind") == "average" for row in rows) else [])
    width = 0.8 / max(len(models), 1)
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 1.4 * len(groups) * max(1, len(models)) ** 0.5)), 4.5))
    x = np.arange(len(groups))
    for i, model in enumerate(models):
        got = [cell.get((t, model)) for t in groups]
        heights = [r["value"] if r else np.nan for r in got]  # nan: no bar where the model does not apply
        errors = np.clip(np.array([[r["value"] - r["ci_low"], r["ci_high"] - r["value"]]
                                   if r and r.get("ci_low") is not None else [0.0, 0.0] for r in got]).T, 0, None)
        ax.bar(x + (i - (len(models) - 1) / 2) * width, heights, width, label=model, yerr=errors,
               error_kw={"elinewidth": 0.8, "capsize": 2})
    metric_of = {row["task"]: row["metric"] for row in rows if row.get("main")}
    metric_of["average"] = "mean"
    ax.set_xticks(x, [f"{t}\n({metric_of[t]})" for t in groups], fontsize=8)
    ax.set_ylabel("score (main metric, 95% interval)")
    ax.set_title(title)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=min(len(models), 3))
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return path


def write_reports(rows: list[dict], out_dir: str | Path, title: str = "Benchmark") -> BenchReport:
    """Write results.json, results.md and results.png under ``out_dir``."""
    out_dir = Path(out_dir)
    table = markdown(rows, title)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md", "png": out_dir / "results.png"}
    atomic_write_json(paths["json"], rows)
    atomic_write_text(paths["markdown"], table)
    if rows:
        bar_chart(rows, paths["png"], title)
    else:
        paths.pop("png")
    return BenchReport(rows=rows, markdown=table, paths=paths)


def read_results(path: str | Path) -> list[dict]:
    return json.loads(Path(path).read_text(encoding="utf-8"))

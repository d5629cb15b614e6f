"""Benchmark reports: ``results.json`` (one row per model, task and metric), ``results.md`` (main
metric per task, models as columns, plus the average over tasks) and ``results.png`` (bars per task).
"""
from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from adapt.io_utils import atomic_path, atomic_write_json, atomic_write_text

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
    """A markdown table: one line per task (its main metric), one column per model, then the average."""
    models, tasks, values = main_table(rows)
    metric_of = {row["task"]: row["metric"] for row in rows if row.get("main")}
    lines = [f"## {title}", "", "| task | metric | " + " | ".join(models) + " |",
             "|---|---|" + "---:|" * len(models)]
    for task in tasks:
        cells = [_fmt(values.get((task, m))) for m in models]
        lines.append(f"| {task} | {metric_of[task]} | " + " | ".join(cells) + " |")
    averages = []
    for m in models:
        scores = [values.get((t, m)) for t in tasks]
        averages.append(_fmt(sum(scores) / len(scores)) if scores and None not in scores else "-")
    lines.append("| **average** | | " + " | ".join(f"**{a}**" for a in averages) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def bar_chart(rows: list[dict], path: str | Path, title: str = "Benchmark") -> Path:
    """Grouped bars: one group per task, one bar per model (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    models, tasks, values = main_table(rows)
    width = 0.8 / max(len(models), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(tasks) * max(1, len(models)) ** 0.5), 4.5))
    x = np.arange(len(tasks))
    for i, model in enumerate(models):
        heights = [values.get((t, model), 0.0) or 0.0 for t in tasks]
        ax.bar(x + (i - (len(models) - 1) / 2) * width, heights, width, label=model)
    metric_of = {row["task"]: row["metric"] for row in rows if row.get("main")}
    ax.set_xticks(x, [f"{t}\n({metric_of[t]})" for t in tasks], fontsize=8)
    ax.set_ylabel("score (main metric)")
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

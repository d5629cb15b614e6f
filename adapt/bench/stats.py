"""Bootstrap intervals and paired significance tests for benchmark scores.

What is resampled (with replacement, ``B = 1000`` times, the items of the task's evaluated split):

* retrieval: queries; the statistic is the mean of the per-query nDCG@10.
* classification: test items, with the predictions of the classifier fitted once on the whole
  training split; the statistic is accuracy (mean correctness). Variance from the training split
  is not included.
* similarity: the rated pairs, each carrying (cosine similarity, gold score); the statistic is the
  Spearman correlation of the resampled pairs.
* clustering: the clustered items, each carrying (gold label, cluster id) from one k-means run on
  all items; the statistic is the V-measure of the resampled items.
* fine-tuned classification (``adapt bench --suite finetune``): the scored items (texts, pairs or words)
  AND the fine-tuning seeds, each item carrying its gold label and one prediction a seed; the statistic
  is the accuracy or macro-F1 of the resampled items averaged over the resampled seeds, so the interval
  covers the variance of fine-tuning as well as that of the items. The seeds are drawn alike for every
  model (seed s of one model is paired with seed s of another: same head initialisation and data order).

The resampled index sets depend only on the task name and its number of items, so every model is
resampled identically: the difference between two models is a *paired* bootstrap (its
distribution is that of ``stat_a[b] - stat_b[b]``). Two-sided p-value: twice the smaller share of
resampled differences on either side of 0 (the 95% percentile interval of the difference
excludes 0 exactly when p < 0.05). The average over tasks is resampled the same way: resample
``b`` of the average is the mean over tasks of each task's resample ``b``. Intervals and tests
are shifted by the drift of the resampled statistic (its mean minus the score on all items),
which is about 0 for means and matters for V-measure.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

B = 1000
LEVEL = 0.95
ALPHA = 0.05
STATISTICS = ("mean", "spearman", "v_measure", "accuracy_over_seeds", "macro_f1_over_seeds")
OVER_SEEDS = ("accuracy_over_seeds", "macro_f1_over_seeds")


@dataclass
class ItemScores:
    """Per-item evidence of one model on one task.

    ``statistic="mean"``: ``values`` is (n,), the per-item scores. ``"spearman"``: (n, 2), the
    predicted and gold similarity of each pair. ``"v_measure"``: (n, 2), the gold label code and
    the cluster id of each item. ``"accuracy_over_seeds"``, ``"macro_f1_over_seeds"``: (n, 1 + S), the
    gold label id then the predicted label id of each of S fine-tuning seeds.
    """

    statistic: str
    values: np.ndarray

    def __post_init__(self):
        self.values = np.asarray(self.values, dtype=np.float64)
        if self.statistic not in STATISTICS:
            raise ValueError(f"unknown statistic {self.statistic!r}; known: {STATISTICS}")
        if len(self.values) == 0:
            raise ValueError("no items to resample")

    @property
    def n(self) -> int:
        return len(self.values)

    def value(self) -> float:
        """The statistic on all items (the reported score; over seeds: the mean over all the seeds)."""
        if self.statistic in OVER_SEEDS:
            seeds = self.values.shape[1] - 1
            return float(self._over_seeds(self.values[None, :, :], np.arange(seeds)[None, :])[0])
        return float(self.resampled(np.arange(self.n)[None, :])[0])

    def _over_seeds(self, data: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """data (B, n, 1 + S), seeds (B, k) seed columns: the statistic averaged over each row's seeds."""
        from adapt.objectives.classification import scores_from_confusion  # torch: only when fine-tuned tasks are scored

        gold = data[..., 0].astype(np.int64)
        out = np.zeros(len(data))
        labels = int(self.values.max()) + 1
        for j in range(seeds.shape[1]):
            pred = np.take_along_axis(data[..., 1:], seeds[:, j][:, None, None], axis=2)[..., 0].astype(np.int64)
            if self.statistic == "accuracy_over_seeds":
                out += (pred == gold).mean(axis=1)
                continue
            for row in range(len(data)):  # macro-F1 as the fine-tuning loop computes it (adapt.objectives.classification)
                cm = np.bincount(gold[row] * labels + pred[row], minlength=labels * labels).reshape(labels, labels)
                out[row] += scores_from_confusion(cm)["macro_f1"]
        return out / seeds.shape[1]

    def resampled(self, idx: np.ndarray) -> np.ndarray:
        """The statistic on each row of item indices ``idx`` (B, n): (B,)."""
        data = self.values[idx]
        if self.statistic in OVER_SEEDS:  # the seeds resampled too, alike for every model with as many
            seeds = self.values.shape[1] - 1
            rng = np.random.default_rng(zlib.crc32(f"seeds|{self.n}|{seeds}|{len(idx)}".encode()))
            return self._over_seeds(data, rng.integers(0, seeds, size=(len(idx), seeds)))
        if self.statistic == "mean":
            return data.mean(axis=1)
        if self.statistic == "spearman":
            return _spearman_rows(data[..., 0], data[..., 1])
        from sklearn.metrics import v_measure_score

        return np.array([v_measure_score(row[:, 0].astype(int), row[:, 1].astype(int)) for row in data])


def _spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman correlation of each row pair (average ranks for ties; 0 where a row is constant)."""
    from scipy.stats import rankdata

    rx, ry = rankdata(x, axis=1), rankdata(y, axis=1)
    rx -= rx.mean(axis=1, keepdims=True)
    ry -= ry.mean(axis=1, keepdims=True)
    denom = np.sqrt((rx ** 2).sum(axis=1) * (ry ** 2).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (rx * ry).sum(axis=1) / denom
    return np.where(denom > 0, out, 0.0)


def resample_indices(n: int, key: str, b: int = B) -> np.ndarray:
    """(b, n) item indices drawn with replacement; the same for every model scored on task ``key``."""
    seed = zlib.crc32(f"{key}|{n}".encode())
    return np.random.default_rng(seed).integers(0, n, size=(b, n))


def bootstrap(items: ItemScores, key: str, b: int = B) -> np.ndarray:
    """The statistic on ``b`` resamples of the items (chunked to bound memory): (b,)."""
    idx = resample_indices(items.n, key, b)
    return np.concatenate([items.resampled(idx[i:i + 100]) for i in range(0, b, 100)])


def interval(dist: np.ndarray, estimate: float | None = None, level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of a bootstrap distribution, shifted by its bias when ``estimate`` is given.

    Statistics that are not means (V-measure, Spearman) drift under resampling with duplicates (the
    V-measure of a resample is higher on average); the percentiles are moved by that drift
    (mean of the resamples minus ``estimate``) so the interval describes the spread around the
    reported score. For a mean the drift is about 0 and this is the percentile interval.
    """
    dist = np.asarray(dist, dtype=np.float64)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(dist, [tail, 100 - tail])
    shift = float(dist.mean() - estimate) if estimate is not None else 0.0
    return float(low - shift), float(high - shift)


def paired(dist: np.ndarray, ref: np.ndarray | None, value: float, ref_value: float | None) -> tuple:
    """(p_value, delta_low, delta_high) of ``value - ref_value`` on the same resamples; Nones without a reference."""
    if ref is None:
        return None, None, None
    diff = np.asarray(dist, dtype=np.float64) - np.asarray(ref, dtype=np.float64)
    return (paired_p_value(dist, ref, value - ref_value), *interval(diff, value - ref_value))


def paired_p_value(dist_a: np.ndarray, dist_b: np.ndarray, observed: float | None = None) -> float:
    """Two-sided paired bootstrap p-value of ``a - b`` (same resamples for both): 1 for identical systems.

    With ``observed`` (the difference on all items) the resampled differences are first shifted by
    their drift, as in :func:`interval`.
    """
    diff = np.asarray(dist_a, dtype=np.float64) - np.asarray(dist_b, dtype=np.float64)
    if observed is not None:
        diff = diff - (diff.mean() - observed)
    below, above = float(np.mean(diff <= 0)), float(np.mean(diff >= 0))
    return min(1.0, 2 * min(below, above))


@dataclass
class Summary:
    """A score with its interval and, against a reference, the paired difference's p-value and interval."""

    value: float
    low: float
    high: float
    p_value: float | None = None  # None for the reference itself or when there is no reference
    delta_low: float | None = None  # the paired difference's 95% interval, with p_value
    delta_high: float | None = None

    @property
    def significant(self) -> bool:
        return self.p_value is not None and self.p_value < ALPHA


def summarize(dists: dict[tuple[str, str], np.ndarray], values: dict[tuple[str, str], float],
              reference: str | None, tasks: list[str] | None = None
              ) -> tuple[dict[tuple[str, str], Summary], dict[str, Summary]]:
    """Per (model, task) summaries and per-model summaries of the average over tasks.

    ``dists[(model, task)]`` are bootstrap distributions made with :func:`bootstrap` (same ``key``
    per task for every model); ``values`` the scores on all items. A model gets an average only
    when it has a distribution on every one of ``tasks`` (default: every task that any model has).
    """
    tasks = list(tasks) if tasks is not None else list(dict.fromkeys(t for _, t in dists))
    models = list(dict.fromkeys(m for m, _ in dists))
    cells: dict[tuple[str, str], Summary] = {}
    for (model, task), dist in dists.items():
        ref = dists.get((reference, task)) if reference and model != reference else None
        value = values[(model, task)]
        cells[(model, task)] = Summary(value, *interval(dist, value),
                                       *paired(dist, ref, value, values.get((reference, task))))
    averages: dict[str, Summary] = {}
    avg_dist = {m: np.mean([dists[(m, t)] for t in tasks], axis=0) for m in models
                if all((m, t) in dists for t in tasks)}
    mean_value = {m: float(np.mean([values[(m, t)] for t in tasks])) for m in avg_dist}
    for model, dist in avg_dist.items():
        ref = avg_dist.get(reference) if reference and model != reference else None
        value = mean_value[model]
        averages[model] = Summary(value, *interval(dist, value), *paired(dist, ref, value, mean_value.get(reference)))
    return cells, averages


def annotate(rows: list[dict], items: dict[tuple[str, str], ItemScores], reference: str | None,
             tasks: list[str]) -> list[dict]:
    """``rows`` (as in results.json) with intervals and tests added, plus one average row per model.

    Main-metric rows with per-item evidence get ``ci_low``/``ci_high``, and against ``reference``
    (a model name) ``p_value`` and ``significant``. Each model scored with evidence on every task
    in ``tasks`` gets a row ``task="average"`` (``kind="average"``, ``main=False``) with the mean of
    its main metrics, its interval and its test against the reference's average.
    """
    values = {(r["model"], r["task"]): r["value"] for r in rows if r.get("main")}
    dists = {key: bootstrap(evidence, key=key[1]) for key, evidence in items.items() if key in values}
    cells, averages = summarize(dists, values, reference, tasks)
    out = []
    for row in rows:
        row = dict(row)
        cell = cells.get((row["model"], row["task"])) if row.get("main") else None
        if cell is not None:
            ref = values.get((reference, row["task"])) if cell.p_value is not None else None
            row.update(ci_low=cell.low, ci_high=cell.high, reference=reference, p_value=cell.p_value,
                       delta=None if ref is None else row["value"] - ref, delta_ci_low=cell.delta_low,
                       delta_ci_high=cell.delta_high, significant=cell.significant if cell.p_value is not None else None)
        out.append(row)
    for model in dict.fromkeys(r["model"] for r in rows):
        summary = averages.get(model)
        if summary is None:
            continue
        mine = [r for r in rows if r["model"] == model and r.get("main")]
        out.append({"model": model, "task": "average", "kind": "average", "metric": "average", "value": summary.value,
                    "main": False, "n": len(tasks), "seconds": round(sum(r["seconds"] for r in mine), 3),
                    "spec": mine[0].get("spec"), "versions": mine[0].get("versions"), "ci_low": summary.low,
                    "ci_high": summary.high, "reference": reference, "p_value": summary.p_value,
                    "delta": None if summary.p_value is None else summary.value - averages[reference].value,
                    "delta_ci_low": summary.delta_low, "delta_ci_high": summary.delta_high,
                    "significant": summary.significant if summary.p_value is not None else None})
    return out

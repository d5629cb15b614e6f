"""One line per converted encoder: is it better than the decoder it came from, beyond the noise?

The encoder is compared with its source as a causal model under the source's best pooling (the
highest average of the mean-, last-token- and sink-prompt mean-pooled baselines): the change of the average over tasks
with its paired bootstrap 95% interval (the same resamples for both models, ``adapt.bench.stats``),
then, per task kind, whether the encoder is ahead or behind (the kind's average change, its
interval excluding 0) or level with it (the interval holding 0).
"""
from __future__ import annotations

import numpy as np

from adapt.bench import stats

CAUSAL_MARKERS = ("(causal, mean)", "(causal, last)", "(causal, mean, sink)")


def _average_dist(model: str, tasks: list[str], dists: dict) -> np.ndarray:
    return np.mean([dists[(model, t)] for t in tasks], axis=0)


def compare(model: str, other: str, tasks: list[str], kinds: dict[str, str], values: dict, dists: dict) -> dict:
    """The paired change of ``model`` against ``other`` over ``tasks``: overall and per task kind."""
    return compare_seeds([model], other, tasks, kinds, values, dists) | {"model": model}


def compare_seeds(models: list[str], other, tasks: list[str], kinds: dict[str, str], values: dict,
                  dists: dict, rng_seed: int = 0) -> dict:
    """The change of a recipe trained with several seeds (``models``: one scored encoder per seed) against
    ``other`` (one model, or another recipe's list of seeds): the difference of the means over seeds, with an
    interval from a two-level bootstrap. Resample ``b`` draws each side's seeds with replacement
    (``rng_seed`` fixes the draws) and takes, for each, its task resample ``b`` (the same items on both
    sides), so the interval holds the spread between seeds as well as the items'. With one seed a side it is
    the paired bootstrap of :func:`compare`. With two or three seeds the seed part of the spread is itself
    uncertain: read it as a lower bound."""
    others = [other] if isinstance(other, str) else list(other)
    n_boot = len(dists[(models[0], tasks[0])])
    rng = np.random.default_rng(rng_seed)
    draws = [rng.integers(0, len(side), size=(len(side), n_boot)) for side in (models, others)]

    def seed_mean(side, draw, subset):  # (B,): resample b's mean over the seeds drawn for b
        stacked = np.stack([_average_dist(m, subset, dists) for m in side])  # (seeds, B)
        return np.take_along_axis(stacked, draw, axis=0).mean(axis=0)

    def change(subset):
        observed = float(np.mean([values[(m, t)] for m in models for t in subset])
                         - np.mean([values[(o, t)] for o in others for t in subset]))
        diff = seed_mean(models, draws[0], subset) - seed_mean(others, draws[1], subset)
        low, high = stats.interval(diff, observed)
        return {"delta": observed, "low": low, "high": high}

    out = {"model": ", ".join(models), "seeds": len(models), "against": ", ".join(others), "tasks": len(tasks),
           **change(tasks), "kinds": {}}
    for kind in sorted(set(kinds[t] for t in tasks)):
        out["kinds"][kind] = change([t for t in tasks if kinds[t] == kind])
    return out


def groups(result: dict) -> dict[str, list[str]]:
    """Task kinds where the change's interval is above 0 (ahead), below 0 (behind), or holds 0 (level)."""
    out = {"ahead": [], "behind": [], "level": []}
    for kind, c in result["kinds"].items():
        out["ahead" if c["low"] > 0 else "behind" if c["high"] < 0 else "level"].append(kind)
    return out


def line(result: dict) -> str:
    """``verdict: ENC vs SOURCE: average +0.031 [+0.012, +0.050] ...; ahead: ...; behind: ...``."""
    def sign(x):
        return f"{x:+.3f}"

    text = (f"verdict: {result['model']} vs {result['against']}: average {sign(result['delta'])} "
            f"[{sign(result['low'])}, {sign(result['high'])}] (paired bootstrap 95%, {result['tasks']} tasks)")
    for name, found in groups(result).items():
        if found:
            text += f"; {name}: {', '.join(found)}"
    return text


def verdicts(rows: list[dict], items: dict, baselines_of: dict[str, list[str]]) -> list[dict]:
    """For each model with causal source baselines (``baselines_of``: model -> its baselines' names), the
    comparison against the better-scoring causal baseline, over the tasks both have evidence on."""
    values = {(r["model"], r["task"]): r["value"] for r in rows if r.get("main")}
    kinds = {r["task"]: r["kind"] for r in rows if r.get("main")}
    out = []
    for model, names in baselines_of.items():
        causal = [n for n in names if any(marker in n for marker in CAUSAL_MARKERS)]  # NAME@dim=N too
        tasks = [t for t in dict.fromkeys(r["task"] for r in rows if r.get("main"))
                 if (model, t) in items and all((n, t) in items for n in causal)]
        if not causal or not tasks:
            continue
        best = max(causal, key=lambda n: np.mean([values[(n, t)] for t in tasks]))
        dists = {(m, t): stats.bootstrap(items[(m, t)], key=t) for m in (model, best) for t in tasks}
        out.append(compare(model, best, tasks, kinds, values, dists))
    return out

"""Bootstrap intervals and paired tests on synthetic per-item scores (adapt.bench.stats)."""
from __future__ import annotations

import numpy as np
import pytest

from adapt.bench import metrics, stats
from adapt.bench.stats import ItemScores


def _correct(n: int, accuracy: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random(n) < accuracy).astype(float)


def test_identical_systems_are_not_significant():
    items = ItemScores("mean", _correct(400, 0.7))
    a, b = stats.bootstrap(items, "t"), stats.bootstrap(ItemScores("mean", items.values.copy()), "t")
    assert np.array_equal(a, b)  # same items, same resamples
    assert stats.paired_p_value(a, b) == 1.0 and stats.paired_p_value(a, b, 0.0) == 1.0


def test_a_clearly_better_system_is_significant_and_a_close_one_is_not():
    base = _correct(500, 0.6, seed=1)
    better = base.copy()
    better[np.flatnonzero(base == 0)[:60]] = 1.0  # 60 more items right: +0.12 accuracy
    close = base.copy()
    close[np.flatnonzero(base == 0)[:2]] = 1.0  # +0.004
    d_base = stats.bootstrap(ItemScores("mean", base), "t")
    assert stats.paired_p_value(stats.bootstrap(ItemScores("mean", better), "t"), d_base, 0.12) < 0.001
    assert stats.paired_p_value(stats.bootstrap(ItemScores("mean", close), "t"), d_base, 0.004) > 0.05


def test_interval_contains_the_estimate_and_narrows_with_n():
    widths = []
    for n in (100, 1600):
        items = ItemScores("mean", _correct(n, 0.7, seed=n))
        low, high = stats.interval(stats.bootstrap(items, f"t{n}"), items.value())
        assert low < items.value() < high and 0 <= low and high <= 1
        widths.append(high - low)
    assert 3 < widths[0] / widths[1] < 5  # about sqrt(16)


def test_resamples_depend_on_the_task_only():
    assert np.array_equal(stats.resample_indices(50, "a"), stats.resample_indices(50, "a"))
    assert not np.array_equal(stats.resample_indices(50, "a"), stats.resample_indices(50, "b"))
    assert stats.resample_indices(50, "a").shape == (stats.B, 50)


def test_item_statistics_match_the_metrics():
    rng = np.random.default_rng(0)
    gold = rng.random(200)
    pred = gold + rng.normal(0, 0.3, 200)
    sim = ItemScores("spearman", np.stack([pred, gold], axis=1))
    assert sim.value() == pytest.approx(metrics.spearman(pred, gold))
    labels = rng.integers(0, 4, 300)
    clusters = np.where(rng.random(300) < 0.7, labels, rng.integers(0, 4, 300))
    clu = ItemScores("v_measure", np.stack([labels, clusters], axis=1))
    assert clu.value() == pytest.approx(metrics.v_measure(labels, clusters))
    for items in (sim, clu):  # the drift-corrected interval stays around the score
        low, high = stats.interval(stats.bootstrap(items, "x"), items.value())
        assert low < items.value() < high
    with pytest.raises(ValueError):
        ItemScores("median", [1.0])


def test_summaries_and_averages():
    tasks = ["r", "c"]
    items = {("ref", "r"): _correct(300, 0.5, 1), ("ref", "c"): _correct(300, 0.5, 2),
             ("good", "r"): np.maximum(_correct(300, 0.5, 1), _correct(300, 0.5, 3)),
             ("good", "c"): _correct(300, 0.5, 2), ("bm25", "r"): _correct(300, 0.4, 4)}
    dists = {k: stats.bootstrap(ItemScores("mean", v), k[1]) for k, v in items.items()}
    values = {k: float(v.mean()) for k, v in items.items()}
    cells, averages = stats.summarize(dists, values, "ref", tasks)
    assert cells[("ref", "r")].p_value is None and not cells[("ref", "r")].significant
    assert cells[("good", "r")].significant and not cells[("good", "c")].significant
    assert cells[("good", "c")].p_value == 1.0
    assert set(averages) == {"ref", "good"}  # bm25 has no score on c: no average
    assert averages["good"].value == pytest.approx((values[("good", "r")] + values[("good", "c")]) / 2)
    assert averages["good"].significant and averages["good"].low < averages["good"].value < averages["good"].high
    # the paired difference's interval: above 0 where significantly better, around 0 for identical items
    good_r, delta_r = cells[("good", "r")], values[("good", "r")] - values[("ref", "r")]
    assert 0 < good_r.delta_low < delta_r < good_r.delta_high
    assert cells[("good", "c")].delta_low == cells[("good", "c")].delta_high == 0
    assert cells[("ref", "r")].delta_low is None and averages["ref"].delta_high is None
    assert averages["good"].delta_low > 0


def test_annotate_adds_intervals_tests_and_average_rows():
    rows = [{"model": m, "task": t, "kind": "classification", "metric": metric, "value": v, "main": metric == "accuracy",
             "n": 300, "seconds": 1.0, "spec": None, "versions": {}}
            for m, seed in (("ref", 1), ("other", 5)) for t in ("a", "b")
            for metric, v in (("accuracy", float(_correct(300, 0.6, seed + len(t)).mean())), ("macro_f1", 0.5))]
    items = {(m, t): ItemScores("mean", _correct(300, 0.6, seed + len(t))) for m, seed in (("ref", 1), ("other", 5))
             for t in ("a", "b")}
    out = stats.annotate(rows, items, "ref", ["a", "b"])
    assert len(out) == len(rows) + 2 and rows[0].get("ci_low") is None  # the input rows are not changed
    main = [r for r in out if r["main"]]
    assert all(r["ci_low"] <= r["value"] <= r["ci_high"] for r in main)
    assert all(r["p_value"] is None for r in main if r["model"] == "ref")
    assert all(0 <= r["p_value"] <= 1 and r["delta"] is not None for r in main if r["model"] == "other")
    assert all(r["delta_ci_low"] <= r["delta"] <= r["delta_ci_high"] for r in main if r["model"] == "other")
    averages = [r for r in out if r["kind"] == "average"]
    assert [r["model"] for r in averages] == ["ref", "other"] and not any(r["main"] for r in averages)
    assert averages[0]["delta_ci_low"] is None and averages[1]["delta_ci_low"] < averages[1]["delta"] < \
        averages[1]["delta_ci_high"]
    assert all("ci_low" not in r for r in out if r["metric"] == "macro_f1")


# ---- the verdict line -----------------------------------------------------------------------------

def _evidence(values):
    from adapt.bench.stats import ItemScores

    return ItemScores("mean", np.asarray(values, dtype=float))


def test_verdict_compares_with_the_better_causal_baseline_and_sorts_kinds():
    from adapt.bench.verdict import line, verdicts

    rng = np.random.default_rng(0)
    base = rng.random((3, 400))
    tasks = {"r": "retrieval", "c": "classification", "s": "similarity"}
    scores = {  # the encoder: clearly above on retrieval, level on classification, clearly below on similarity
        "enc": {"r": base[0] + 0.3, "c": base[1] + rng.normal(0, 0.01, 400), "s": base[2] - 0.3},
        "src (causal, mean)": {"r": base[0], "c": base[1], "s": base[2]},
        "src (causal, last)": {"r": base[0] - 0.2, "c": base[1] - 0.2, "s": base[2] - 0.2},  # worse: not chosen
        "src (bidirectional, mean, untrained)": {"r": base[0] + 1, "c": base[1] + 1, "s": base[2] + 1},  # not causal
    }
    items = {(m, t): _evidence(v) for m, per in scores.items() for t, v in per.items()}
    rows = [{"model": m, "task": t, "kind": tasks[t], "metric": "x", "value": float(np.mean(v)), "main": True}
            for m, per in scores.items() for t, v in per.items()]
    [result] = verdicts(rows, items, {"enc": [m for m in scores if m != "enc"]})
    assert result["against"] == "src (causal, mean)"
    assert result["delta"] == pytest.approx(0.0, abs=0.01) and result["low"] < 0 < result["high"]
    text = line(result)
    assert text.startswith("verdict: enc vs src (causal, mean): average")
    assert "ahead: retrieval" in text and "behind: similarity" in text and "level: classification" in text
    assert verdicts(rows, items, {}) == []


def test_verdict_takes_the_sink_baseline_when_it_is_the_best_causal_one():
    from adapt.bench.verdict import verdicts

    rng = np.random.default_rng(2)
    base = rng.random(300)
    scores = {"enc": base + 0.1, "src (causal, mean)": base, "src (causal, last)": base - 0.1,
              "src (causal, mean, sink)": base + 0.05}
    items = {(m, "t"): _evidence(v) for m, v in scores.items()}
    rows = [{"model": m, "task": "t", "kind": "retrieval", "metric": "x", "value": float(np.mean(v)), "main": True}
            for m, v in scores.items()]
    [result] = verdicts(rows, items, {"enc": [m for m in scores if m != "enc"]})
    assert result["against"] == "src (causal, mean, sink)" and result["delta"] == pytest.approx(0.05, abs=1e-6)


def test_compare_seeds_holds_the_spread_between_seeds():
    from adapt.bench.verdict import compare, compare_seeds

    rng = np.random.default_rng(1)
    base = {"r": rng.random(400), "c": rng.random(400)}
    kinds = {"r": "retrieval", "c": "classification"}
    scores = {"src": base,
              "good-s0": {t: v + 0.05 for t, v in base.items()}, "good-s1": {t: v + 0.05 for t, v in base.items()},
              "wild-s0": {t: v + 0.15 for t, v in base.items()}, "wild-s1": {t: v - 0.05 for t, v in base.items()}}
    values = {(m, t): float(np.mean(v)) for m, per in scores.items() for t, v in per.items()}
    dists = {(m, t): stats.bootstrap(_evidence(v), key=t) for m, per in scores.items() for t, v in per.items()}
    tasks = ["r", "c"]
    one = compare_seeds(["good-s0"], "src", tasks, kinds, values, dists)
    assert one == compare("good-s0", "src", tasks, kinds, values, dists) | {"seeds": 1}
    # two equal seeds: the single seed's interval; both +0.05 on every item, so it is exactly +0.05
    two = compare_seeds(["good-s0", "good-s1"], "src", tasks, kinds, values, dists)
    assert two["delta"] == pytest.approx(0.05) and two["low"] == pytest.approx(0.05) == two["high"]
    # seeds +0.15 and -0.05: the same mean change, but the interval spans the two seeds, 0 included (to within
    # the drift correction of adapt.bench.stats.interval: the draws hold the two seeds not exactly 50/50)
    wild = compare_seeds(["wild-s0", "wild-s1"], "src", tasks, kinds, values, dists)
    assert wild["delta"] == pytest.approx(0.05) and wild["seeds"] == 2
    assert wild["low"] == pytest.approx(-0.05, abs=0.01) and wild["high"] == pytest.approx(0.15, abs=0.01)
    assert wild["kinds"]["retrieval"]["low"] < 0 < wild["kinds"]["retrieval"]["high"]
    # recipe against recipe, each over its seeds: level, the wild one's spread on the other side
    both = compare_seeds(["wild-s0", "wild-s1"], ["good-s0", "good-s1"], tasks, kinds, values, dists)
    assert both["delta"] == pytest.approx(0.0, abs=1e-12) and both["against"] == "good-s0, good-s1"
    assert both["low"] == pytest.approx(-0.10, abs=0.01) and both["high"] == pytest.approx(0.10, abs=0.01)

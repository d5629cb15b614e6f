"""Fine-tuned evaluation (``adapt bench --suite finetune``): every model fine-tuned per task and seed by the
library's own code, scored on held-out items with intervals over items and seeds, the paired verdict against
the source's causal classifier, fits kept on disk so a rerun redoes nothing; and the suites' splits."""
import json
import random

import numpy as np
import pytest

from adapt.bench import finetuned
from adapt.bench.runner import run_bench
from adapt.bench.stats import ItemScores, bootstrap
from adapt.bench.suites import finetune as suite
from adapt.bench.tasks import FinetuneTask
from adapt.errors import ConfigError
from tests.pipeline.test_finetune import NEGATIVE, POSITIVE, encoder_dir, toy_rows  # noqa: F401 - fixture

BUDGET = {"tuning": "full", "lr": {"full": 3e-3, "lora": 3e-3}, "epochs": 3, "batch_size": 8, "max_length": 32}


def _toy_tasks():
    train, test = toy_rows(64, 0), toy_rows(40, 1)
    rng = random.Random(2)
    sentences = [[rng.choice(POSITIVE + NEGATIVE) for _ in range(rng.randint(3, 7))] for _ in range(80)]
    tags = [["ANIMAL" if w in POSITIVE else "O" for w in s] for s in sentences]
    return [FinetuneTask(name="toy-sequence", train_examples=[r["text"] for r in train],
                         train_labels=[r["label"] for r in train], eval_examples=[r["text"] for r in test],
                         eval_labels=[r["label"] for r in test]),
            FinetuneTask(name="toy-tokens", examples="token", train_examples=sentences[:56], train_labels=tags[:56],
                         eval_examples=sentences[56:], eval_labels=tags[56:])]


@pytest.fixture(scope="module")
def report(encoder_dir, tmp_path_factory):  # noqa: F811
    from tests.tiny import tiny_decoder, tiny_tokenizer

    root = tmp_path_factory.mktemp("ftbench")
    tokenizer = tiny_tokenizer()
    source = root / "source"
    tiny_decoder("llama", vocab_size=len(tokenizer)).save_pretrained(source)
    tokenizer.save_pretrained(source)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(suite, "BUDGET", {**suite.BUDGET, **BUDGET, "seeds": 2})
        out = root / "bench"
        result = run_bench([str(encoder_dir)], tasks=_toy_tasks(), out_dir=out, baselines=True, source=str(source),
                           references=False, show_progress=False)
    return result, out, source


def test_every_model_is_fine_tuned_and_scored_with_intervals_over_items_and_seeds(report, encoder_dir):  # noqa: F811
    result, out, _ = report
    rows = json.loads((out / "results.json").read_text())
    models = list(dict.fromkeys(r["model"] for r in rows))
    assert models == ["enc", "source (causal classifier)", "source (bidirectional, untrained)"]
    cell = {(r["model"], r["task"], r["metric"]): r for r in rows}
    for model in models:
        for task in ("toy-sequence", "toy-tokens"):
            for metric in ("accuracy", "macro_f1"):
                row = cell[(model, task, metric)]
                assert row["seeds"] == 2 and row["ci_low"] <= row["value"] <= row["ci_high"], row
    assert cell[("enc", "toy-sequence", "accuracy")]["value"] > 0.8  # a trained head beats chance (0.5)
    assert cell[("enc", "toy-tokens", "accuracy")]["value"] > 0.8
    assert cell[("enc", "toy-tokens", "accuracy")]["n"] == sum(len(t) for t in _toy_tasks()[1].eval_labels)  # words
    vs = cell[("enc", "average", "average")]
    assert vs["reference"] == "source (causal classifier)" and vs["p_value"] is not None
    assert any(line.startswith("verdict (fine-tuned): enc vs source (causal classifier): accuracy")
               for line in result.verdicts)
    assert "macro-F1" in result.markdown and "3 epochs" in result.markdown
    assert len(list((out / "finetune").rglob("seed-*.json"))) == 3 * 2 * 2


def test_a_rerun_fits_nothing_again(report, encoder_dir, monkeypatch):  # noqa: F811
    _, out, source = report
    before = json.loads((out / "results.json").read_text())

    def refuse(*args, **kwargs):
        raise AssertionError("fitted again")

    monkeypatch.setattr(finetuned, "_fit_and_predict", refuse)
    monkeypatch.setattr(suite, "BUDGET", {**suite.BUDGET, **BUDGET, "seeds": 2})
    run_bench([str(encoder_dir)], tasks=_toy_tasks(), out_dir=out, baselines=True, source=str(source),
              references=False, show_progress=False)
    after = json.loads((out / "results.json").read_text())
    assert [(r["model"], r["task"], r["metric"], r["value"]) for r in after] == \
           [(r["model"], r["task"], r["metric"], r["value"]) for r in before]


def test_the_causal_baseline_stays_causal(report, monkeypatch):
    """The source's causal classifier is fitted with bidirectional=False; the other two bidirectional."""
    _, _, source = report
    seen = []
    monkeypatch.setattr(finetuned, "_fit_and_predict",
                        lambda base, spec, task, seed, budget: seen.append(spec.bidirectional) or
                        {"labels": ["animal", "nlp"], "predicted": task.eval_labels, "seconds": 0.0, "train_loss": []})
    tasks = _toy_tasks()[:1]
    finetuned.run_finetune_bench([str(source)], tasks, out_dir=report[1].parent / "causal", baselines=True,
                                 source=str(source), references=False, seeds=1, show_progress=False)
    assert seen == [None, False, True]  # the given folder (as it loads: bidirectional), causal, untrained


def test_mixing_fine_tuned_and_embedding_tasks_is_refused(encoder_dir, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="run apart from embedding tasks"):
        run_bench([str(encoder_dir)], tasks=[_toy_tasks()[0], "lee-similarity"], out_dir=tmp_path, show_progress=False)


def test_over_seeds_statistics_average_the_seeds_and_widen_with_their_disagreement():
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(0)
    gold = rng.integers(0, 3, 300)
    agree = np.stack([np.where(rng.random(300) < 0.8, gold, (gold + 1) % 3)] * 3, axis=1)
    differ = np.stack([np.where(rng.random(300) < p, gold, (gold + 1) % 3) for p in (0.6, 0.8, 0.95)], axis=1)
    for table in (agree, differ):
        items = ItemScores("macro_f1_over_seeds", np.concatenate([gold[:, None], table], axis=1))
        assert items.value() == pytest.approx(np.mean([f1_score(gold, table[:, s], average="macro") for s in range(3)]))
    width = {}
    for name, table in (("agree", agree), ("differ", differ)):
        dist = bootstrap(ItemScores("accuracy_over_seeds", np.concatenate([gold[:, None], table], axis=1)), "t")
        width[name] = np.percentile(dist, 97.5) - np.percentile(dist, 2.5)
    assert width["differ"] > width["agree"]


def test_the_suites_train_on_the_same_examples_and_score_disjoint_items():
    pytest.importorskip("gensim")
    test, dev = suite.load_task("polarity-finetune"), suite.load_task("polarity-finetune-dev")
    assert test.train_examples == dev.train_examples and test.train_labels == dev.train_labels
    trained = set(test.train_examples)
    assert not trained & set(test.eval_examples) and not trained & set(dev.eval_examples)
    assert not set(test.eval_examples) & set(dev.eval_examples)
    assert len(dev.eval_examples) == 30 and len(test.eval_examples) == 100
    assert set(suite.SUITES) == {"finetune", "finetune-dev"} and len(suite.FINETUNE_TASKS) == 7

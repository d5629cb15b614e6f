"""The offline ``quick`` suite: real English text that installs with gensim's test data.

Five tasks, all deterministic (fixed seeds, stable orders) and small enough that a 135M decoder runs
the suite in a few minutes on two CPU cores:

* ``lee-similarity``: Lee et al. (2005) news documents, 50 documents with human similarity ratings;
  Spearman of cosine similarity against the upper triangle of the ratings (1,225 pairs).
* ``polarity-classification``: 200 Pang & Lee movie-review sentences, positive or negative;
  stratified 50/50 train/test split, logistic regression.
* ``newsgroup-classification``: 198 posts of two newsgroups (alt.atheism, sci.space), headers
  (they name the group) and quoted lines removed, cut to the first 80 words (about 100 tokens);
  stratified 50/50 split, logistic regression.
* ``newsgroup-clustering``: the same 198 posts clustered with k-means, k = 2 (V-measure).
* ``wiki-retrieval``: 100 or so Wikipedia articles; the query is an article's first sentence, the corpus
  is passages of about 64 words from the rest of each article's text (up to 3 per article), the
  relevant passages are those of the query's article.

Parsed tasks are cached as JSON under ``$ADAPT_CACHE/bench`` (default ``~/.cache/adapt/bench``).
"""
from __future__ import annotations

import bz2
import io
import json
import os
import pickle
import re
import zlib
from pathlib import Path

import numpy as np

from adapt.bench.tasks import ClassificationTask, ClusteringTask, RetrievalTask, SimilarityTask, Task
from adapt.errors import DataError
from adapt.files import atomic_write_text

VERSION = 1  # bump when a loader changes what it produces, so stale caches are not reused
SEED = 0
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
PASSAGES_PER_ARTICLE = 3
PASSAGE_WORDS = 64
NEWSGROUP_WORDS, NEWSGROUP_CHARS = 80, 500  # posts are cut to about 100 tokens: the suite stays fast


def cache_dir() -> Path:
    """Where parsed task data are cached: ``$ADAPT_CACHE/bench`` or ``~/.cache/adapt/bench``."""
    root = os.environ.get("ADAPT_CACHE") or Path.home() / ".cache" / "adapt"
    return Path(root) / "bench"


def _datapath(name: str) -> Path:
    try:
        from gensim.test.utils import datapath
    except ImportError:
        raise DataError("the quick suite reads gensim's test data: pip install gensim==4.4.0") from None
    path = Path(datapath(name))
    if not path.exists():
        raise DataError(f"gensim test data file {path} is missing; reinstall gensim")
    return path


def stratified_split(labels: list[str], test_fraction: float = 0.5, seed: int = SEED) -> tuple[list[int], list[int]]:
    """Indices of a train and a test split with each label in the same proportion in both."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in sorted(set(labels)):
        idx = np.array([i for i, x in enumerate(labels) if x == label])
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(len(idx) * test_fraction))
        test.extend(idx[:n_test].tolist())
        train.extend(idx[n_test:].tolist())
    return sorted(train), sorted(test)


def lee_similarity() -> SimilarityTask:
    docs = _datapath("lee.cor").read_text(encoding="latin-1").splitlines()
    ratings = np.loadtxt(_datapath("similarities0-1.txt"))
    if ratings.shape != (len(docs), len(docs)):
        raise DataError(f"lee.cor has {len(docs)} documents but the ratings matrix is {ratings.shape}")
    rows, cols = np.triu_indices(len(docs), k=1)
    return SimilarityTask(name="lee-similarity", description="Lee news document similarity (human ratings)",
                          texts=[d.strip() for d in docs], pairs=list(zip(rows.tolist(), cols.tolist())),
                          scores=ratings[rows, cols].tolist())


def polarity_classification() -> ClassificationTask:
    texts, labels = [], []
    for line in _datapath("pang_lee_polarity.cor").read_text(encoding="latin-1").splitlines():
        label, _, text = line.partition(" ")
        if label.startswith("__label__") and text.strip():
            labels.append(label.removeprefix("__label__"))
            texts.append(text.strip())
    train, test = stratified_split(labels)
    return ClassificationTask(name="polarity-classification", description="Pang & Lee movie-review sentence sentiment",
                              train_texts=[texts[i] for i in train], train_labels=[labels[i] for i in train],
                              test_texts=[texts[i] for i in test], test_labels=[labels[i] for i in test])


class _Placeholder:
    """Stands in for numpy's array/dtype constructors: records the pickled state, runs nothing."""

    def __init__(self, *args):
        self.args = args
        self.state = None

    def __setstate__(self, state):
        self.state = state


def _reconstructor(cls, base, state):
    if cls is not dict or base is not dict:
        raise pickle.UnpicklingError("only dict subclasses are allowed")
    return dict(state or {})


class _BunchUnpickler(pickle.Unpickler):
    """Reads an old scikit-learn ``Bunch`` pickle as a dict; every other global is refused.

    numpy arrays come back as inert placeholders that ``_to_array`` decodes from raw bytes, so
    no numpy code runs on the pickled data either.
    """

    ALLOWED = {("copy_reg", "_reconstructor"): _reconstructor, ("copyreg", "_reconstructor"): _reconstructor,
               ("sklearn.datasets.base", "Bunch"): dict, ("sklearn.utils", "Bunch"): dict,
               ("__builtin__", "dict"): dict, ("builtins", "dict"): dict,
               ("numpy.core.multiarray", "_reconstruct"): _Placeholder, ("numpy", "ndarray"): "ndarray",
               ("numpy", "dtype"): _Placeholder}

    def find_class(self, module, name):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}") from None


def _to_array(obj) -> np.ndarray:
    """Decode a placeholder array: state = (version, shape, dtype placeholder, fortran, raw bytes)."""
    _, shape, dtype, _, raw = obj.state
    descr = dtype.args[0]
    byteorder = dtype.state[1] if dtype.state and dtype.state[1] in "<>" else ""
    if not re.fullmatch(r"[iufS]\d+", descr):
        raise DataError(f"mini_newsgroup: unexpected array dtype {descr!r}")
    data = raw.encode("latin-1") if isinstance(raw, str) else raw
    return np.frombuffer(data, dtype=np.dtype(byteorder + descr)).reshape(shape)


def _newsgroup_posts() -> tuple[list[str], list[str]]:
    raw = zlib.decompress(_datapath("mini_newsgroup").read_bytes())
    try:
        bunch = _BunchUnpickler(io.BytesIO(raw), encoding="latin-1").load()
        target = _to_array(bunch["target"]).astype(int)
        names = list(bunch["target_names"])
        posts = list(bunch["data"])
    except (pickle.UnpicklingError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"mini_newsgroup is not the expected scikit-learn Bunch ({e})") from None
    kept = [(_post_body(post), names[t]) for post, t in zip(posts, target)]
    kept = [(text, label) for text, label in kept if len(text.split()) >= 8]  # drop near-empty posts
    return [text for text, _ in kept], [label for _, label in kept]


def _post_body(post: str) -> str:
    """The author's own words: no headers (they name the newsgroup), quotes or attribution lines."""
    _, _, body = post.partition("\n\n")
    own = [line for line in body.splitlines() if not _QUOTE.search(line)]
    words = (" ".join(own) if any(line.strip() for line in own) else body).split()
    return " ".join(words[:NEWSGROUP_WORDS])[:NEWSGROUP_CHARS]


_QUOTE = re.compile(r"^\s*[>|:]|^In article|(writes|wrote|says):\s*$")


def newsgroup_classification() -> ClassificationTask:
    texts, labels = _newsgroup_posts()
    train, test = stratified_split(labels)
    return ClassificationTask(name="newsgroup-classification", description="20 Newsgroups posts, two groups",
                              train_texts=[texts[i] for i in train], train_labels=[labels[i] for i in train],
                              test_texts=[texts[i] for i in test], test_labels=[labels[i] for i in test])


def newsgroup_clustering() -> ClusteringTask:
    # same texts in the same order as the classification task (train then test): shared embeddings
    cls = newsgroup_classification()
    return ClusteringTask(name="newsgroup-clustering", description="20 Newsgroups posts, two groups, k-means",
                          texts=cls.train_texts + cls.test_texts, labels=cls.train_labels + cls.test_labels)


def _prose_paragraphs(wikitext: str) -> list[str]:
    from gensim.corpora.wikicorpus import filter_wiki

    paragraphs = []
    for line in filter_wiki(wikitext).splitlines():
        line = re.sub(r"'{2,}", "", line).strip()
        if line.startswith("=") or len(line.split()) < 8:  # headings, table cells, captions
            continue
        paragraphs.append(" ".join(line.split()))
    return paragraphs


def _passages(paragraphs: list[str]) -> list[str]:
    """Greedy ~PASSAGE_WORDS-word passages of whole paragraphs; long paragraphs are cut by words."""
    out, current = [], []
    for para in paragraphs:
        words = para.split()
        if current and len(current) + len(words) > PASSAGE_WORDS * 1.2:
            out.append(" ".join(current))
            current = []
        current.extend(words)
        while len(current) >= PASSAGE_WORDS:
            out.append(" ".join(current[:PASSAGE_WORDS]))
            current = current[PASSAGE_WORDS:]
    if len(current) >= PASSAGE_WORDS // 3:
        out.append(" ".join(current))
    return out


def _first_sentence(paragraph: str) -> str:
    match = re.search(r"^(.{40,}?[.!?])\s+[A-Z]", paragraph)
    sentence = match.group(1) if match else paragraph
    return " ".join(sentence.split()[:60])


def wiki_retrieval() -> RetrievalTask:
    from gensim.corpora.wikicorpus import extract_pages

    query_ids, queries, corpus_ids, corpus, qrels = [], [], [], [], {}
    with bz2.open(_datapath(WIKI_FILE)) as f:
        for title, text, page_id in extract_pages(f):
            redirect = text.lstrip().lower().startswith("#redirect")
            if redirect or "(disambiguation)" in title or title.startswith("List of"):
                continue
            paragraphs = _prose_paragraphs(text)
            # the lead: the first prose paragraph that defines the subject ("X is ...")
            lead = next((i for i, p in enumerate(paragraphs) if " is " in p or " was " in p or " are " in p), None)
            if lead is None:
                continue
            passages = _passages(paragraphs[lead + 1:])[:PASSAGES_PER_ARTICLE]
            if len(passages) < 2:
                continue
            qid = f"q{page_id}"
            query_ids.append(qid)
            queries.append(_first_sentence(paragraphs[lead]))
            qrels[qid] = {}
            for k, passage in enumerate(passages):
                corpus_ids.append(f"d{page_id}-{k}")
                corpus.append(passage)
                qrels[qid][f"d{page_id}-{k}"] = 1.0
    return RetrievalTask(name="wiki-retrieval", description="Wikipedia: an article's first sentence -> its passages",
                         query_ids=query_ids, queries=queries, corpus_ids=corpus_ids, corpus=corpus, qrels=qrels)


BUILDERS = {
    "lee-similarity": lee_similarity,
    "polarity-classification": polarity_classification,
    "newsgroup-classification": newsgroup_classification,
    "newsgroup-clustering": newsgroup_clustering,
    "wiki-retrieval": wiki_retrieval,
}
QUICK_TASKS = list(BUILDERS)
TASK_NAMES = set(BUILDERS)
RANK = 0  # first in `adapt bench --help`
SUITES = {"quick": ("offline: real English text from gensim's test data (similarity, 2x classification, clustering, "
                    "Wikipedia retrieval); a smoke test, too small to separate encoders (about 53k tokens)",
                    QUICK_TASKS)}


def read_cached_task(path: Path) -> Task | None:
    """A parsed task from its JSON cache file; None when there is none or it is damaged (then rebuilt)."""
    if not path.exists():
        return None
    try:
        return Task.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def write_cached_task(path: Path, task: Task) -> None:
    """Cache a parsed task as JSON; a read-only home only means it is parsed again next time."""
    try:
        atomic_write_text(path, json.dumps(task.to_dict()))
    except OSError:
        pass


def load_quick_task(name: str, *, use_cache: bool = True) -> Task:
    """One task of the quick suite, from the JSON cache when present (parsing Wikipedia takes seconds)."""
    if name not in BUILDERS:
        raise DataError(f"unknown quick task {name!r}; known: {', '.join(BUILDERS)}")
    return cached_task(cache_dir() / f"quick-v{VERSION}" / f"{name}.json", BUILDERS[name], use_cache)


def cached_task(path: Path, build, use_cache: bool = True) -> Task:
    """The task cached at ``path``, else ``build()`` (then cached there unless ``use_cache`` is False)."""
    cached = read_cached_task(path) if use_cache else None
    if cached is not None:
        return cached
    task = build()
    if use_cache:
        write_cached_task(path, task)
    return task


def load_task(name: str) -> Task:
    """The suites registry's entry (adapt.bench.suites)."""
    return load_quick_task(name)

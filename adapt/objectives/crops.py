"""Unsupervised pairs cut from the same document (Izacard et al., 2022, "Contriever": independent cropping).

    adapt convert MODEL -o OUT --stages mlm,crops --data corpus.txt

Each document of ``data.sources`` (a paragraph of a text file, a JSON line, a row) gives, at every
step, two spans cut independently (each ``contrastive.crop_ratio`` of its words, at a uniform start):
one is the query, the other its positive, the other documents' spans in the batch the negatives.
With ``contrastive.query_words: [low, high]`` the query span is ``low`` to ``high`` words instead, as
short as a search query; ``contrastive.query_in_document`` cuts that share of queries from inside their
own document span (shared words: the exact-term matching BM25 does; Lee et al.'s ICT keeps 10%).
Unlike SimCSE's two dropout views of one sentence, the two views share meaning, not words, which is
what retrieval asks of an encoder. Crops are a pure function of (seed, step, process), so a resumed
run cuts the same ones. Everything else is :class:`adapt.objectives.contrastive.Contrastive`'s.
"""
from __future__ import annotations

import numpy as np

from adapt.data.token_store import resolve_data_sources
from adapt.errors import ConfigError
from adapt.objectives.contrastive import Contrastive
from adapt.data.pairs import crop, crop_words, load_documents, text_key

KINDS = {"crops": {"contrastive": {"loss": "crops"}}}

MIN_CROP_WORDS = 8
EVAL_STREAM = 1


class Crops(Contrastive):
    example_name = "documents"
    cuts_crops = True

    def load_examples(self):
        c, d = self.c, self.cfg.data
        if not d.sources:
            raise ConfigError("a crops stage needs documents: pass --data PATH or set data.sources for the stage")
        return load_documents(resolve_data_sources(d.sources), text_field=d.text_field,
                              min_words=2 * MIN_CROP_WORDS, max_texts=c.max_texts)

    def start(self, step: int, accelerator) -> None:
        super().start(step, accelerator)
        self._rank = accelerator.process_index

    def step(self, module, accelerator, step: int):
        self._rng = np.random.default_rng([self.cfg.train.seed, step, self._rank])
        return super().step(module, accelerator, step)

    def evaluate(self, module, accelerator) -> dict:
        self._rng = np.random.default_rng([self.cfg.train.seed, EVAL_STREAM, accelerator.process_index])
        return super().evaluate(module, accelerator)

    def texts(self, examples):
        """Queries (first crops) then documents (second crops); keys name the source document, so a
        document that appears twice in the corpus is never its own negative."""
        c = self.c
        spans = [self._pair(doc.split()) for doc in examples]
        keys = [text_key(doc) for doc in examples]
        return ([c.query_prompt + a for a, _ in spans] + [c.document_prompt + b for _, b in spans], len(spans),
                keys, keys)

    def _pair(self, words: list[str]) -> tuple[str, str]:
        """(query span, document span) of one document's ``words``."""
        c = self.c
        if c.query_in_document and self._rng.random() < c.query_in_document:
            document = self._document(words)
            return self._query(document.split()), document
        return self._query(words), self._document(words)

    def _query(self, words: list[str]) -> str:
        c = self.c
        return crop_words(words, self._rng, *c.query_words) if c.query_words else self._document(words)

    def _document(self, words: list[str]) -> str:
        return crop(words, self._rng, self.c.crop_ratio, MIN_CROP_WORDS, self.c.max_length)


OBJECTIVE = Crops

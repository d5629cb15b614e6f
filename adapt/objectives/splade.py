"""SPLADE after MLM: the masked-LM head becomes a sparse encoder (Formal et al., 2021, "SPLADE v2").

    adapt convert MODEL -o OUT --stages mlm,splade --data corpus.txt                        # crops of documents
    adapt convert MODEL -o OUT --stages mlm,splade --data corpus.txt --pairs pairs.jsonl    # supervised pairs

MLM trains the head that predicts each position's own token over the vocabulary; SPLADE pools those
logits into one weight per vocabulary term (:mod:`adapt.model.splade`: max over tokens of log1p(relu)) and
trains them for retrieval:

- Pairs: ``contrastive.pairs`` (``--pairs``) when given, else two spans cropped from each document of
  ``data.sources`` as the crops stage cuts them (:mod:`adapt.objectives.crops`); every positive and
  hard negative of the batch (and of every process, ``contrastive.gather``) is a candidate for every
  query, scored by dot product, with cross-entropy on the positive.
- FLOPS regularizer on the query and document vectors, weighted by ``splade.lambda_q`` and
  ``splade.lambda_d``, both grown quadratically from 0 over the first ``splade.lambda_warmup`` of the
  steps (SPLADE v2), so the ranking is learnt before the vectors are made sparse.
- Gradient caching (``contrastive.mini_batch``, ``train.grad_accum``) as the contrastive stages have it:
  both terms of the loss are functions of the vectors, so the cache is exact.

- ``splade.queries: idf``: inference-free queries, each token's IDF over the training documents
  (:func:`adapt.model.splade.idf_vectors`), no model run; only the documents go through the model (half the
  forward passes), and only their FLOPS counts. The export routes queries to sentence-transformers'
  ``SparseStaticEmbedding`` and documents to the model (a ``Router``).
- ``splade.own_terms``: a floor under each document's own tokens, for documents that keep their words as BM25 does,
  with the learnt expansion on top. After a short MLM stage, ranking with IDF queries and FLOPS leaves few of a
  document's own tokens active (measured: 0.6% at step 40 of 120), and ranking losses cannot bring them back:
  relu has no gradient below 0. This loss acts on the pooled logit before relu (the module returns it, the loss
  takes log1p(relu)): the IDF-weighted mean over a document's tokens of relu(1 - z), z its pooled logit plus
  bias. Evaluation reports ``eval/own_terms_active``, the share of a document's own tokens (IDF above 0) that are
  active, wherever the IDF is known (``queries: idf`` or ``own_terms``).
- A per-term bias (``splade.term_bias``, on by default) added to the pooled logits before relu, started
  from a calibration batch of the training texts at about ``splade.init_active_terms`` active terms per
  text (:func:`adapt.model.splade.calibrate_term_bias`), then trained with the rest: a decoder's head has no
  bias and its logits are mostly positive, so without one nearly every term is active in every text.

The stage exports a sparse encoder (:mod:`adapt.export.sparse`; ``splade.top_k`` keeps each vector's k
largest weights). Evaluation reports the held-out ranking loss and accuracy and the average number of
active terms per query and per document.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from adapt.model.families import head_logit_scale
from adapt.config.settings import RunConfig
from adapt.model.embedding import tokenize
from adapt.errors import ConfigError
from adapt.objectives import StageContext, StepOutput
from adapt.objectives.contrastive import Contrastive, check_crop_settings
from adapt.objectives.crops import EVAL_STREAM, Crops
from adapt.objectives.infonce import all_gather_rows, false_negative_mask
from adapt.model.splade import (SparseLM, active_terms, calibrate_term_bias, flops, idf_vectors, idf_weights, query_prefix,
                          ranking_loss, regularizer_scale, term_weights)

KINDS = {"splade": {}}
CALIBRATION_STREAM = 2  # the crops of the term bias's calibration batch: their own random stream
CALIBRATION_TEXTS = 64  # queries and documents of the calibration batch (at most)
log = logging.getLogger(__name__)


class Splade(Crops):
    """Ranking loss over sparse dot products + FLOPS, on pairs or on crops of documents."""

    uses_lm_head = True  # the head is the encoder's output layer: it trains, and it is exported
    export_kind = "sparse"
    loss_name = "ranking + FLOPS"

    inapplicable = {
        "export.sink_prompt": "it keeps a token out of a pooled vector, and a SPLADE stage's weights are a max "
                              "over every token",
        "contrastive.keep_source": "it compares pooled dense vectors with the source's, and a SPLADE stage's are "
                                   "vocabulary weights",
    }

    def __init__(self, cfg: RunConfig):
        for name, why in self.inapplicable.items():
            section, key = name.split(".")
            if getattr(getattr(cfg, section), key):
                raise ConfigError(f"{name} does not apply to a SPLADE stage: {why}; set {name} to "
                                  f"{getattr(getattr(RunConfig(), section), key)!r} for this stage")
        super().__init__(cfg)
        self.s = cfg.splade
        # the data settings are the contrastive section's; where the pairs come from decides the loss name, and
        # Matryoshka sizes (prefixes of a dense vector) do not apply to vocabulary weights
        self.c = dataclasses.replace(cfg.contrastive, loss="pairs" if cfg.contrastive.pairs else "crops",
                                     matryoshka_dims=[], matryoshka_weights=[])
        if self.c.loss == "pairs":
            check_crop_settings(self.c, "supervised pairs (contrastive.pairs)")
        self.dropout = self.c.dropout  # as the model has, unless asked: no SimCSE views here
        self.example_name = "pairs" if self.c.loss == "pairs" else "documents"
        self.warmup_steps = round(self.s.lambda_warmup * cfg.train.max_steps)
        self._scale = 0.0
        self.idf_queries = self.s.queries == "idf"
        self._idf, self._prefix, self._n_queries, self._query_vectors, self._own = None, "", 0, None, None
        self._parts: dict[str, float] = {}  # the last training loss's terms (logged as loss/NAME)

    # ---- data: pairs (contrastive) or crops --------------------------------------------------
    def load_examples(self):
        return Contrastive.load_examples(self) if self.c.loss == "pairs" else Crops.load_examples(self)

    def texts(self, examples):
        out = Contrastive.texts(self, examples) if self.c.loss == "pairs" else Crops.texts(self, examples)
        self._n_queries = out[1]  # for chunks(): inference-free queries do not go through the model
        return out

    def documents(self) -> list[str]:
        """The training documents the inference-free queries' IDF is counted over (crops: the documents; pairs:
        positives and hard negatives, each once)."""
        if self.c.loss != "pairs":
            return list(self.train_set)
        return list(dict.fromkeys(d for p in self.train_set for d in [p.positive, *p.negatives]))

    def chunks(self, texts: list[str], device, skips: list[int] | None = None):
        """As the contrastive stages cut them; with inference-free queries, the queries' IDF vectors are made here
        (kept for the loss) and only the documents are cut into chunks for the model. Where the IDF is known
        (inference-free queries, ``own_terms``), each document's own tokens weighted by it are kept too.
        ``skips`` is always None: a SPLADE stage refuses a sink prompt."""
        n = self._n_queries
        if self._idf is not None:
            self._own = idf_vectors(self.tokenizer, texts[n:], self._idf, "", device, max_length=self.c.max_length)
        if not self.idf_queries:
            return super().chunks(texts, device, skips)
        self._query_vectors = idf_vectors(self.tokenizer, texts[:n], self._idf, self._prefix, device)
        return super().chunks(texts[n:], device)

    def split(self, weights: torch.Tensor, n_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries, documents) of a batch's vectors in text order: the inference-free queries are kept aside."""
        if self.idf_queries:
            return self._query_vectors.to(weights.device), weights
        return weights[:n_queries], weights[n_queries:]

    # ---- model and loss -----------------------------------------------------------------------
    def configure_model(self, model, tokenizer) -> list[int]:
        if self.s.term_bias and head_logit_scale(model.config) is None:
            raise ConfigError(f"splade.term_bias: this '{model.config.model_type}' model soft-caps its logits "
                              "(final_logit_softcapping), so no bias added to its head can be exported as a "
                              "linear layer; set splade.term_bias: false (without it most terms stay active)")
        return super().configure_model(model, tokenizer)

    def prepare(self, ctx: StageContext) -> None:
        super().prepare(ctx)
        self._accelerator = ctx.accelerator

    def module(self, model) -> torch.nn.Module:
        if self.idf_queries or self.s.own_terms:
            head = model.get_output_embeddings()
            vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
            documents = self.documents()
            self._prefix = query_prefix(self.tokenizer)
            self._idf = idf_weights(self.tokenizer, documents, vocab, self._prefix)
            log.info("splade: IDF over %d training documents%s, for %s", len(documents),
                     ", after a leading space" if self._prefix else "",
                     " and ".join(w for w, on in (("the queries", self.idf_queries),
                                                  ("the own-token floor", self.s.own_terms)) if on))
        bias = self.calibrate(SparseLM(model)) if self.s.term_bias else None
        return SparseLM(model, bias, query_idf=self._idf if self.idf_queries else None,
                        pre_activation=bool(self.s.own_terms))

    @torch.no_grad()
    def calibrate(self, sparse: SparseLM) -> torch.Tensor:
        """The term bias's start (:func:`adapt.model.splade.calibrate_term_bias`) from the pooled logits of the first
        training examples' texts, the same on every process. Run where training runs (the model is moved
        there, as Accelerate would) unless it is sharded or quantized, then where it is. A resumed run's
        checkpoint then replaces it."""
        acc = getattr(self, "_accelerator", None)
        param = next(sparse.model.parameters())
        movable = (acc is not None and str(acc.distributed_type.value) not in ("FSDP", "DEEPSPEED", "MEGATRON_LM")
                   and not getattr(sparse.model, "is_loaded_in_4bit", False)
                   and not getattr(sparse.model, "is_loaded_in_8bit", False))
        device = acc.device if movable else param.device
        sparse.model.to(device)
        rng, self._rng = getattr(self, "_rng", None), np.random.default_rng([self.cfg.train.seed, CALIBRATION_STREAM])
        try:
            texts, *_ = self.texts(self.train_set[:max(1, CALIBRATION_TEXTS // 2)])
        finally:
            self._rng = rng
        was_training = sparse.training
        sparse.eval()
        if self.idf_queries:  # the bias is for the documents' vectors: the queries' are the IDF
            texts = texts[self._n_queries:]
        texts = texts[:CALIBRATION_TEXTS]  # in chunks of 8: a (B, T, V) logits tensor is large
        pooled = torch.cat([sparse(**tokenize(self.tokenizer, texts[s:s + 8], self.c.max_length, device), raw=True)
                            for s in range(0, len(texts), 8)])
        sparse.train(was_training)
        bias = calibrate_term_bias(pooled, self.s.init_active_terms)
        log.info("splade term bias: calibrated on %d texts for about %d active terms per text", len(pooled),
                 self.s.init_active_terms)
        return bias

    def loss_fn(self, n_queries: int, positive_keys, doc_keys, inverse, *, gather: bool, source=None):
        """``source`` is always None: a SPLADE stage refuses contrastive.keep_source."""
        lambda_q, lambda_d = self._scale * self.s.lambda_q, self._scale * self.s.lambda_d

        def fn(out):  # (queries + documents, V), the chunks' order undone by `inverse`
            dev, out = out.device, out[inverse]
            weights = term_weights(out) if self.s.own_terms else out  # pre-activation: see module()
            queries, docs = self.split(weights, n_queries)
            candidates, keys, offset = docs, torch.tensor(doc_keys, dtype=torch.long, device=dev), 0
            if gather:
                candidates, offset = all_gather_rows(docs)
                keys, _ = all_gather_rows(keys)
            targets = offset + torch.arange(n_queries, device=dev)
            mask = false_negative_mask(torch.tensor(positive_keys, dtype=torch.long, device=dev), keys, targets)
            loss, correct = ranking_loss(queries, candidates, targets, mask)
            ranking = loss.detach()
            if self.s.own_terms:  # each document's own tokens above 0 before relu, the rare ones first
                own, pooled = self._own.to(dev), self.split(out, n_queries)[1]
                floor = (own * (1 - pooled).relu()).sum(dim=1) / own.sum(dim=1).clamp_min(1e-6)
                loss = loss + self.s.own_terms * floor.mean()
            regularizer = lambda_d * flops(docs) + (0.0 if self.idf_queries else lambda_q * flops(queries))
            self._parts = {"ranking": float(ranking), "flops": float(torch.as_tensor(regularizer).detach()),
                           **({"own_terms": float(loss.detach() - ranking)} if self.s.own_terms else {})}
            return loss + regularizer, correct
        return fn

    def step(self, module, accelerator, step: int) -> StepOutput:
        self._scale = regularizer_scale(step, self.warmup_steps)
        out = super().step(module, accelerator, step)
        return StepOutput(out.loss, out.tokens, "splade", dict(self._parts))

    @torch.no_grad()
    def evaluate(self, module, accelerator) -> dict:
        """Held-out ranking loss (without FLOPS) and top-1 accuracy among each batch's documents, and the average
        active terms per query and per document; batches shared out over processes, sums gathered."""
        acc, bs = accelerator, self.cfg.train.batch_size
        self._rng = np.random.default_rng([self.cfg.train.seed, EVAL_STREAM, acc.process_index])
        batches = [self.eval_set[s:s + bs] for s in range(0, len(self.eval_set), bs)]
        batches = [b for b in batches if len(b) >= 2]
        if not batches:
            return {}
        model = acc.unwrap_model(module)  # no DDP collectives: processes may run different batches
        model.eval()
        sums = torch.zeros(8, dtype=torch.float64)  # loss x queries, correct, queries, query/doc terms, docs, own terms
        rounds = -(-len(batches) // acc.num_processes)
        with acc.autocast():
            for r in range(rounds):  # every process runs as many forwards (FSDP gathers weights in forward)
                k = r * acc.num_processes + acc.process_index
                texts, n_queries, positive_keys, doc_keys = self.texts(batches[min(k, len(batches) - 1)])
                chunks, inverse = self.chunks(texts, acc.device)
                weights = torch.cat([model(**chunk) for chunk in chunks])[inverse]
                weights = term_weights(weights) if self.s.own_terms else weights
                if k >= len(batches):
                    continue
                dev = weights.device
                queries, docs = self.split(weights, n_queries)
                targets = torch.arange(n_queries, device=dev)
                mask = false_negative_mask(torch.tensor(positive_keys, device=dev), torch.tensor(doc_keys, device=dev),
                                           targets)
                loss, correct = ranking_loss(queries, docs, targets, mask)
                own = self._own.to(dev) > 0 if self._own is not None else torch.zeros_like(docs, dtype=torch.bool)
                sums += torch.tensor([float(loss) * n_queries, float(correct), n_queries,
                                      float(active_terms(queries).sum()), float(active_terms(docs).sum()), len(docs),
                                      float((own & (docs > 0)).sum()), float(own.sum())], dtype=torch.float64)
        model.train()
        total = acc.gather_for_metrics(sums.to(acc.device).unsqueeze(0)).sum(0)
        n, n_docs = max(float(total[2]), 1.0), max(float(total[5]), 1.0)
        out = {"eval/splade_loss": float(total[0]) / n, "eval/splade_acc": float(total[1]) / n,
               "eval/active_terms_query": float(total[3]) / n, "eval/active_terms_doc": float(total[4]) / n_docs}
        if float(total[7]):
            out["eval/own_terms_active"] = float(total[6]) / float(total[7])
        return out

    # ---- records ------------------------------------------------------------------------------
    def summary(self) -> dict:
        s = self.s
        return {"pairs_from": self.c.loss, "lambda_q": s.lambda_q, "lambda_d": s.lambda_d,
                "lambda_warmup_steps": self.warmup_steps, "top_k": s.top_k, "term_bias": s.term_bias,
                "queries": s.queries, "own_terms": s.own_terms,
                "init_active_terms": s.init_active_terms if s.term_bias else None, "batch_per_process": self.batch,
                "mini_batch": self.mini_batch, **({"mini_batch_auto": self.auto_record} if self.auto_record else {}),
                "data": self.counts, "train_examples": len(self.train_set), "eval_examples": len(self.eval_set)}

    def export_prompts(self) -> dict:
        c = self.c
        return {"query": c.query_prompt, "document": c.document_prompt} if c.query_prompt or c.document_prompt else {}


OBJECTIVE = Splade

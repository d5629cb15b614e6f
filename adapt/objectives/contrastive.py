"""Contrastive stages after MLM, as LLM2Vec has: unsupervised SimCSE and supervised pairs.

    adapt convert MODEL -o OUT --stages mlm,simcse --data corpus.txt
    adapt convert MODEL -o OUT --stages mlm,contrastive --data corpus.txt --pairs pairs.jsonl

- SimCSE (Gao et al., 2021): each sentence of ``data.sources`` is embedded twice in train mode; the
  two dropout views are positives, the other sentences of the batch negatives. Decoders usually
  ship with dropout 0, so ``contrastive.dropout`` is set on their dropouts for the stage.
- Pairs: JSON lines ``{"query": ..., "positive": ..., "negatives": [...]}``; every positive and hard
  negative of the batch is a candidate for every query (InfoNCE / MultipleNegativesRankingLoss).
  Documents equal to a query's positive are masked out of its negatives (no false negatives).
- Embeddings are pooled as the exported encoder pools (``export.pooling``), prompts included; with
  ``export.sink_prompt`` every text gets the sink in front and the sink and prompt are left out of pooling,
  as the export then does (:mod:`adapt.model.pooling`).
- One optimizer step per batch of ``train.batch_size x train.grad_accum`` queries per process:
  ``grad_accum`` enlarges the batch through gradient caching (``contrastive.mini_batch``) instead of
  splitting the in-batch negatives; with several processes every process's documents are negatives
  for every query (:mod:`adapt.objectives.infonce`).
- Matryoshka (``contrastive.matryoshka_dims: [full, 256, 64]``): the loss is summed over those prefixes
  of the pooled vector, each re-normalized, so the exported encoder can be truncated
  (``SentenceTransformer(DIR, truncate_dim=256)``, ``adapt embed --dim 256``); the sizes go into the export.
- ``contrastive.mini_batch: auto``: the chunk whose activations fit the device's free memory, from the model's
  shape and ``max_length``, chosen as the stage starts and recorded in its summary; no caching where the whole
  step fits or caching is refused (fp16, DeepSpeed: then a warning if the step may not fit).
- Keeping the source (``contrastive.keep_source: W``): the loss adds ``W x (1 - linear CKA)`` between the batch's
  pooled vectors and the stage's source's (its starting weights, with the attention it had: a causal decoder's
  stays causal; LoRA switches its adapters off, full fine-tuning keeps a frozen copy), so what a linear probe
  read from the source stays readable while the contrastive loss reshapes the space.
"""
from __future__ import annotations

import contextlib
import copy
import logging

import numpy as np
import torch

from adapt.config.settings import RunConfig
from adapt.data.batches import batch_iterator
from adapt.data.token_store import resolve_data_sources
from adapt.model.bidirectional import attends_causally, causal_attention
from adapt.model.embedding import Embedder, set_dropout, tokenize
from adapt.errors import ConfigError, DataError
from adapt.objectives import ObjectiveBase, StageContext, StepOutput
from adapt.model.loading import load_config
from adapt.objectives.infonce import (all_gather_rows, auto_mini_batch, contrastive_backward, estimate_text_bytes,
                                      false_negative_mask, free_memory, info_nce, linear_cka, matryoshka_info_nce,
                                      matryoshka_sizes)
from adapt.model.pooling import check_sink, prompt_token_count
from adapt.data.pairs import data_fingerprint, load_pairs, load_sentences, split_eval, text_key

log = logging.getLogger(__name__)

KINDS = {"simcse": {"contrastive": {"loss": "simcse"}}, "contrastive": {"contrastive": {"loss": "pairs"}}}
CROP_SETTINGS = ("crop_ratio", "query_words", "query_in_document")  # read only where crops are cut
def check_crop_settings(c, what: str) -> None:
    """A stage that cuts no crops (SimCSE sentences, supervised pairs) would silently ignore the crops settings:
    an error that names them, so that a user does not believe a setting trained what it did not."""
    defaults = type(c)()
    changed = [k for k in CROP_SETTINGS if getattr(c, k) != getattr(defaults, k)]
    if changed:
        raise ConfigError(f"contrastive.{', contrastive.'.join(changed)} only shape crops cut from documents "
                          f"(kind: crops, or a splade stage without pairs); this stage trains on {what}: remove "
                          f"{'them' if len(changed) > 1 else 'it'}, or use kind: crops")


class Contrastive(ObjectiveBase):
    """InfoNCE on SimCSE sentences or supervised pairs (``contrastive.loss``)."""

    micro_batches = 1  # the whole batch is one micro-batch: grad_accum enlarges it through caching
    example_name = "sentences"  # what the examples are called in messages
    cuts_crops = False  # whether the crops settings (CROP_SETTINGS) shape this stage's examples

    @property
    def loss_name(self) -> str:
        """What the training loss is, for the loss plot: InfoNCE (summed over Matryoshka sizes), + keep_source."""
        return ("InfoNCE" + (" (Matryoshka sum)" if self.c.matryoshka_dims else "")
                + (" + keep_source" if self.c.keep_source else ""))

    def __init__(self, cfg: RunConfig):
        self.cfg, self.kind, self.c = cfg, cfg.kind, cfg.contrastive
        self.batch = cfg.train.batch_size * cfg.train.grad_accum
        self.auto = self.c.mini_batch == "auto"  # resolved in prepare(), from the model and the free memory
        self.auto_record: dict = {}
        self.mini_batch = (0 if self.auto else self.c.mini_batch) or (
            cfg.train.batch_size if cfg.train.grad_accum > 1 else 0)
        self.may_cache = True  # check_launch: False where caching is refused (fp16, DeepSpeed)
        self.dropout = self.c.dropout if self.c.dropout is not None else (0.1 if self.c.loss == "simcse" else None)
        self.train_set = self.eval_set = None
        self.sizes: list[tuple[int, float]] = []  # Matryoshka (size, weight), largest first; [] off
        self.hidden_size = None
        self._skip_counts: tuple[int, int] | None = None  # sink + (query, document) prompt tokens, counted once
        self.source_causal = True  # keep_source: whether the stage's source attended causally
        self._parts: dict[str, float] = {}  # keep_source: the last training loss's terms
        self.frozen_source = None  # keep_source under full fine-tuning: the source's weights, frozen
        if not self.cuts_crops:
            check_crop_settings(self.c, "supervised pairs" if self.c.loss == "pairs" else "SimCSE sentences")

    # ---- data -----------------------------------------------------------------------------
    def load_examples(self) -> tuple[list, dict]:
        """All examples of the stage and the counts of what was skipped."""
        c, d = self.c, self.cfg.data
        if c.loss == "pairs":
            if not c.pairs:
                raise ConfigError("a supervised contrastive stage needs pairs: pass --pairs FILE (JSON lines of "
                                  '{"query": ..., "positive": ..., "negatives": [...]}) or set contrastive.pairs')
            return load_pairs(c.pairs, max_pairs=c.max_texts)
        if not d.sources:
            raise ConfigError("SimCSE needs text: pass --data PATH or set data.sources for the simcse stage")
        return load_sentences(resolve_data_sources(d.sources), text_field=d.text_field, min_words=c.min_words,
                              max_texts=c.max_texts)

    def read_data(self) -> dict:
        t = self.cfg.train
        examples, self.counts = self.load_examples()
        train, held = split_eval(len(examples), self.cfg.data.eval_fraction, t.eval_batches * t.batch_size, t.seed)
        self.train_set, self.eval_set = [examples[i] for i in train], [examples[i] for i in held]
        self.counts = {"examples": len(examples), **self.counts}
        return {"examples": len(examples), "train": data_fingerprint(self.train_set),
                "eval": data_fingerprint(self.eval_set)}

    def check_launch(self, accelerator) -> None:
        from accelerate.utils import DistributedType

        t, caching = self.cfg.train, bool(self.mini_batch)
        self.may_cache = t.mixed_precision != "fp16" and accelerator.distributed_type != DistributedType.DEEPSPEED
        if t.mixed_precision == "fp16" and caching:
            raise ConfigError("gradient caching (contrastive.mini_batch, train.grad_accum > 1) does not support fp16 "
                              "loss scaling: use train.mixed_precision=bf16 or no")
        if self.c.keep_source and accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            raise ConfigError("contrastive.keep_source runs the source outside the sharded engine, which DeepSpeed and "
                              "FSDP do not allow: use DDP (one process per device), or set contrastive.keep_source=0")
        if accelerator.distributed_type == DistributedType.DEEPSPEED and caching:
            raise ConfigError("gradient caching backpropagates outside DeepSpeed's engine: use DDP or FSDP, or set "
                              "contrastive.mini_batch=0 and train.grad_accum=1")
        need = self.batch * accelerator.num_processes
        if len(self.train_set) < need:
            what = "pairs" if self.c.loss == "pairs" else self.example_name
            raise DataError(f"only {len(self.train_set)} training {what}, fewer than one batch of {need} "
                            f"(train.batch_size x grad_accum x {accelerator.num_processes} processes): add data or "
                            "lower train.batch_size")
        if self.batch < 2:
            raise ConfigError("a contrastive stage needs at least 2 queries per batch (in-batch negatives)")
        if self.c.matryoshka_dims:  # sizes the model does not have fail before OUT is written
            self.resolve_sizes(load_config(self.cfg.model))

    def resolve_sizes(self, config) -> None:
        """``contrastive.matryoshka_dims`` against the model's hidden size (the pooled vector's)."""
        self.sizes = matryoshka_sizes(self.c.matryoshka_dims, self.c.matryoshka_weights, config)
        self.hidden_size = int(config.get_text_config().hidden_size)

    # ---- model ----------------------------------------------------------------------------
    def configure_model(self, model, tokenizer) -> list[int]:
        self.tokenizer = tokenizer
        query, document = self._prompts()
        check_sink(tokenizer, self.cfg.export.sink_prompt, prompts={"query": query, "document": document})
        if self.c.matryoshka_dims:
            self.resolve_sizes(model.config)
        if self.sizes and self.sizes[0][0] != self.hidden_size:
            log.warning("contrastive.matryoshka_dims %s leaves out the full size %d: the untruncated vectors are not "
                        "trained; add 'full'", self.c.matryoshka_dims, self.hidden_size)
        self.n_dropouts = set_dropout(model, self.dropout) if self.dropout is not None else None
        if self.dropout and not self.n_dropouts:
            log.warning("found no dropout to set on this %s model; SimCSE views then differ only by LoRA dropout",
                        model.config.model_type)
        return []

    def prepare(self, ctx: StageContext) -> None:
        self.tokenizer = ctx.tokenizer
        if self.auto:
            self.resolve_mini_batch(ctx.model, ctx.accelerator)
        if self.c.keep_source:
            self.source_causal = attends_causally(load_config(self.cfg.model))
            if self.cfg.tuning.method == "full":  # LoRA needs no copy: its adapters switch off
                log.info("contrastive.keep_source under full fine-tuning keeps a frozen copy of the source (the "
                         "model's memory twice); LoRA would not")
                self.frozen_source = Embedder(copy.deepcopy(ctx.model).requires_grad_(False).eval(),
                                              self.cfg.export.pooling).to(ctx.accelerator.device)

    def module(self, model) -> torch.nn.Module:
        return Embedder(model, self.cfg.export.pooling)

    def texts_per_example(self) -> int:
        """Texts a step embeds per example: a query and its positive (pairs: and at most ``hard_negatives``)."""
        return 2 + (self.c.hard_negatives if self.c.loss == "pairs" else 0)

    def resolve_mini_batch(self, model, accelerator) -> None:
        """``contrastive.mini_batch: auto``: the chunk (0: none) whose activations fit the free memory, the same on
        every process (the smallest); where caching is refused, none, with a warning if the step may not fit."""
        t, tuning, full = self.cfg.train, self.cfg.tuning, self.cfg.tuning.method == "full"
        params = list({id(p): p for p in model.parameters()}.values())
        weights = sum(p.numel() * p.element_size() for p in params)
        # 16-bit weights keep their norms' values in float32 (0.81 of float32's bytes), autocast some of both
        wide = t.mixed_precision != "no" or max(p.element_size() for p in params if p.is_floating_point()) > 2
        element = 4.0 if wide else 3.3
        per_text = estimate_text_bytes(model.config, max_length=self.c.max_length, element_size=element,
                                       checkpointing=tuning.gradient_checkpointing, lm_head=self.uses_lm_head)
        # full: gradients, AdamW's two moments and keep_source's frozen copy; the weights, unless the GPU holds them
        # already (on the CPU they may still be mapped from their file, unread, and counted free)
        on_device = accelerator.device.type == "cuda" and params[0].device == accelerator.device
        fixed = (3 + bool(self.c.keep_source)) * weights * full + (0 if on_device else weights)
        texts = self.batch * self.texts_per_example()
        free = free_memory(accelerator.device, accelerator.num_processes if accelerator.device.type == "cpu" else 1)
        chunk = 0 if free is None else auto_mini_batch(texts=texts, per_text_bytes=per_text, free_bytes=free,
                                                       fixed_bytes=fixed)
        if accelerator.num_processes > 1:  # every process cuts as many chunks (FSDP gathers weights per forward)
            chunk = int(accelerator.gather(torch.tensor([chunk or texts], device=accelerator.device)).min())
            chunk = 0 if chunk >= texts else chunk
        if chunk and not self.may_cache:
            log.warning("contrastive.mini_batch auto: %d texts a step may not fit in %.1f GiB, and gradient caching "
                        "is refused here (fp16 or DeepSpeed): lower train.batch_size or contrastive.max_length",
                        texts, (free or 0) / 2**30)
            chunk = 0
        self.mini_batch = chunk or self.mini_batch  # grad_accum > 1 caches at batch_size when all would fit
        self.auto_record = {"free_gib": None if free is None else round(free / 2**30, 1), "texts_per_step": texts,
                            "estimated_gib_per_text": round(per_text / 2**30, 3), "chose": self.mini_batch}
        log.info("contrastive.mini_batch auto: %s (%d texts a step, about %.2f GiB each, %s GiB free)",
                 self.mini_batch or "no gradient caching", texts, per_text / 2**30, self.auto_record["free_gib"])

    # ---- batches --------------------------------------------------------------------------
    def texts(self, examples) -> tuple[list[str], int, list[int], list[int]]:
        """(texts to embed: queries then documents, number of queries, positive keys, document keys).
        Each query's positive is document ``i`` of this process (documents: positives, then negatives)."""
        c = self.c
        if c.loss == "simcse":
            keys = [text_key(s) for s in examples]
            return list(examples) + list(examples), len(examples), keys, keys
        queries = [c.query_prompt + p.query for p in examples]
        docs = [p.positive for p in examples] + [n for p in examples for n in p.negatives[:c.hard_negatives]]
        positive_keys = [text_key(p.positive) for p in examples]
        return queries + [c.document_prompt + d for d in docs], len(queries), positive_keys, [text_key(d) for d in docs]

    def _prompts(self) -> tuple[str, str]:
        """The (query, document) prompts :meth:`texts` puts before its texts (SimCSE puts none)."""
        c = self.c
        return (c.query_prompt, c.document_prompt) if c.loss != "simcse" else ("", "")

    def sunk(self, texts: list[str], n_queries: int) -> tuple[list[str], list[int] | None]:
        """``texts`` with ``export.sink_prompt`` in front, and each one's leading tokens left out of pooling
        (the sink and the text's query or document prompt, counted as the export counts them, once per run);
        no sink: ``(texts, None)``."""
        sink = self.cfg.export.sink_prompt
        if not sink:
            return texts, None
        if self._skip_counts is None:
            self._skip_counts = tuple(prompt_token_count(self.tokenizer, sink + p) for p in self._prompts())
        query, document = self._skip_counts
        return [sink + t for t in texts], [query if i < n_queries else document for i in range(len(texts))]

    def chunks(self, texts: list[str], device, skips: list[int] | None = None) -> tuple[list[dict], torch.Tensor]:
        """Texts sorted by length cut into chunks of ``mini_batch`` (one chunk without caching), and the
        permutation that puts the chunks' embeddings back in text order. ``skips``: each text's leading
        tokens to leave out of pooling (:meth:`sunk`)."""
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        size = self.mini_batch or len(texts)
        chunks = [tokenize(self.tokenizer, [texts[i] for i in order[s:s + size]], self.c.max_length, device)
                  for s in range(0, len(order), size)]
        if skips is not None:
            for s, chunk in zip(range(0, len(order), size), chunks):
                chunk["prompt_length"] = torch.tensor([skips[i] for i in order[s:s + size]], device=device)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return chunks, inverse.to(device)

    @torch.no_grad()
    def source_embeddings(self, module, accelerator, chunks: list[dict]) -> torch.Tensor:
        """The source's pooled vectors of ``chunks`` (chunk order), for ``keep_source``: the frozen copy, or the
        model with its LoRA adapters off; with the attention the source had; in eval mode (no dropout)."""
        embedder = self.frozen_source if self.frozen_source is not None else accelerator.unwrap_model(module)
        model = embedder.model
        off = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
        was_training = embedder.training
        embedder.eval()
        try:
            with off, causal_attention(model, self.source_causal), accelerator.autocast():
                return torch.cat([embedder(**chunk) for chunk in chunks])
        finally:
            embedder.train(was_training)

    def loss_fn(self, n_queries: int, positive_keys, doc_keys, inverse, *, gather: bool, source=None):
        """InfoNCE of the queries over the documents (every process's with ``gather``); with ``source`` (the
        source's vectors of the same texts, chunk order) plus ``keep_source x (1 - linear CKA)``."""
        def fn(embeddings):
            dev = embeddings.device
            keep = self.c.keep_source * (1 - linear_cka(embeddings, source)) if source is not None else 0.0
            embeddings = embeddings[inverse]
            queries, docs = embeddings[:n_queries], embeddings[n_queries:]
            keys = torch.tensor(doc_keys, dtype=torch.long, device=dev)
            offset = 0
            if gather:
                docs, offset = all_gather_rows(docs)
                keys, _ = all_gather_rows(keys)
            targets = offset + torch.arange(n_queries, device=dev)
            mask = false_negative_mask(torch.tensor(positive_keys, dtype=torch.long, device=dev), keys, targets)
            if self.sizes:
                loss, per_size = matryoshka_info_nce(queries, docs, targets, self.c.temperature, mask, self.sizes)
                correct = per_size[self.sizes[0][0]][1]
            else:
                loss, correct = info_nce(queries, docs, targets, self.c.temperature, mask)
            if source is not None:  # the loss's two terms, logged as loss/infonce and loss/keep_source
                self._parts = {"infonce": float(loss.detach()), "keep_source": float(keep.detach())}
            return loss + keep, correct
        return fn

    def start(self, step: int, accelerator) -> None:
        self._batches = batch_iterator(np.arange(len(self.train_set)), self.batch, seed=self.cfg.train.seed,
                                       start_step=step, rank=accelerator.process_index,
                                       world_size=accelerator.num_processes)

    def step(self, module, accelerator, step: int) -> StepOutput:
        acc = accelerator
        examples = [self.train_set[i] for i in next(self._batches)]
        texts, n_queries, positive_keys, doc_keys = self.texts(examples)
        texts, skips = self.sunk(texts, n_queries)
        chunks, inverse = self.chunks(texts, acc.device, skips)
        source = self.source_embeddings(module, acc, chunks) if self.c.keep_source else None
        loss, _ = contrastive_backward(module, chunks,
                                       self.loss_fn(n_queries, positive_keys, doc_keys, inverse, gather=self.c.gather,
                                                    source=source),
                                       cache=len(chunks) > 1, no_sync=lambda: acc.no_sync(module),
                                       backward=acc.backward)
        tokens = sum(int(c["attention_mask"].sum()) for c in chunks) * acc.num_processes
        return StepOutput(loss, tokens, self.c.loss, self._parts if self.c.keep_source else {})

    @torch.no_grad()
    def evaluate(self, module, accelerator) -> dict:
        """Held-out loss and top-1 accuracy (positive ranked first among its batch's documents), the held-out
        batches shared out over processes and the sums gathered. SimCSE keeps dropout on (seeded per batch):
        identical views would make the task trivial. Loss and accuracy are those of the full vectors; with
        Matryoshka sizes, also ``eval/{loss}_loss@N`` and ``_acc@N`` for each smaller size N. With ``keep_source``,
        ``eval/source_cka``: the linear CKA with the source's vectors, averaged over the held-out batches."""
        acc, name, bs = accelerator, self.c.loss, self.cfg.train.batch_size
        smaller = [size for size, _ in self.sizes if size < (self.hidden_size or 0)]
        batches = [self.eval_set[s:s + bs] for s in range(0, len(self.eval_set), bs)]
        batches = [b for b in batches if len(b) >= 2]
        if not batches:
            return {}
        model = acc.unwrap_model(module)  # no DDP collectives: processes may run different batches
        model.train(name == "simcse")
        # loss x queries, correct, queries, per size (loss x queries, correct), then CKA with the source, batches
        sums = torch.zeros(3 + 2 * len(smaller) + 2, dtype=torch.float64)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        rounds = -(-len(batches) // acc.num_processes)
        with torch.random.fork_rng(devices=devices), acc.autocast():
            for r in range(rounds):  # every process runs as many forwards (FSDP gathers weights in forward)
                k = r * acc.num_processes + acc.process_index
                torch.manual_seed(self.cfg.train.seed + k)
                texts, n_queries, positive_keys, doc_keys = self.texts(batches[min(k, len(batches) - 1)])
                texts, skips = self.sunk(texts, n_queries)
                chunks, inverse = self.chunks(texts, acc.device, skips)
                embeddings = torch.cat([model(**chunk) for chunk in chunks])[inverse]
                if k >= len(batches):
                    continue
                dev = embeddings.device
                queries, docs = embeddings[:n_queries], embeddings[n_queries:]
                targets = torch.arange(n_queries, device=dev)
                mask = false_negative_mask(torch.tensor(positive_keys, device=dev), torch.tensor(doc_keys, device=dev),
                                           targets)
                loss, ok = info_nce(queries, docs, targets, self.c.temperature, mask)
                _, per_size = matryoshka_info_nce(queries, docs, targets, self.c.temperature, mask,
                                                  [(size, 1.0) for size in smaller])
                row = [float(loss) * n_queries, float(ok), n_queries]
                for size in smaller:
                    row += [float(per_size[size][0]) * n_queries, float(per_size[size][1])]
                if self.c.keep_source:
                    source = self.source_embeddings(module, acc, chunks)[inverse]
                    row += [float(linear_cka(embeddings, source)), 1]
                else:
                    row += [0, 0]
                sums += torch.tensor(row, dtype=torch.float64)
        model.train()
        total = acc.gather_for_metrics(sums.to(acc.device).unsqueeze(0)).sum(0)
        n = max(float(total[2]), 1.0)
        out = {f"eval/{name}_loss": float(total[0]) / n, f"eval/{name}_acc": float(total[1]) / n}
        for i, size in enumerate(smaller):
            out[f"eval/{name}_loss@{size}"] = float(total[3 + 2 * i]) / n
            out[f"eval/{name}_acc@{size}"] = float(total[4 + 2 * i]) / n
        if self.c.keep_source:
            out["eval/source_cka"] = float(total[-2]) / max(float(total[-1]), 1.0)
        return out

    # ---- records --------------------------------------------------------------------------
    def summary(self) -> dict:
        c = self.c
        return {"loss": c.loss, "temperature": c.temperature, "dropout": self.dropout,
                "pooling": self.cfg.export.pooling, "batch_per_process": self.batch, "mini_batch": self.mini_batch,
                **({"mini_batch_auto": self.auto_record} if self.auto_record else {}),
                "data": self.counts, "train_examples": len(self.train_set), "eval_examples": len(self.eval_set),
                **({"matryoshka_dims": self.matryoshka_dims()} if self.sizes else {}),
                **({"keep_source": c.keep_source, "source_attention": "causal" if self.source_causal else
                    "bidirectional"} if c.keep_source else {})}

    def matryoshka_dims(self) -> list[int]:
        return [size for size, _ in self.sizes]

    def export_prompts(self) -> dict:
        c = self.c
        if c.loss == "pairs" and (c.query_prompt or c.document_prompt):
            return {"query": c.query_prompt, "document": c.document_prompt}
        return {}


OBJECTIVE = Contrastive

"""Contrastive stages after MLM, as LLM2Vec has: unsupervised SimCSE and supervised pairs.

    adapt convert MODEL -o OUT --stages mlm,simcse --data corpus.txt
    adapt convert MODEL -o OUT --stages mlm,contrastive --data corpus.txt --pairs pairs.jsonl

- SimCSE (Gao et al., 2021): each sentence of ``data.sources`` is embedded twice in train mode; the
  two dropout views are positives, the other sentences of the batch negatives. Decoders usually
  ship with dropout 0, so ``contrastive.dropout`` is set on their dropouts for the stage.
- Pairs: JSON lines ``{"query": ..., "positive": ..., "negatives": [...]}``; every positive and hard
  negative of the batch is a candidate for every query (InfoNCE / MultipleNegativesRankingLoss).
  Documents equal to a query's positive are masked out of its negatives (no false negatives).
- Embeddings are pooled as the exported encoder pools (``export.pooling``), prompts included.
- Gradient caching (Gao et al., 2021, "GradCache"): with ``contrastive.mini_batch`` the batch is
  embedded without grad in chunks, the loss and its gradient w.r.t. the embeddings are computed,
  then each chunk is embedded again with grad (same dropout masks: the RNG is replayed) and the
  cached gradient backpropagated, so a batch larger than memory trains exactly as if embedded at once.
- Several processes: each process's documents are gathered (with their gradient) so every query
  sees every process's negatives; DDP's gradient average then equals the full global-batch gradient.

The loop is :class:`adapt.train.Trainer`'s (checkpoints, exact resume, NaN guard, Ctrl-C, logs);
:class:`ContrastiveTrainer` supplies the step. :func:`train_contrastive` is one stage: load the
previous stage's merged model -> tune (full, LoRA, QLoRA) -> train -> merge -> export.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from adapt.config import RunConfig
from adapt.errors import ConfigError, DataError
from adapt.train import Trainer

log = logging.getLogger(__name__)

DATA_FINGERPRINT = "data.json"  # in a contrastive run's run/ folder: what it trained on (checked on --resume)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


# ------------------------------------------------------------------------------------------- data

@dataclass(frozen=True)
class Pair:
    query: str
    positive: str
    negatives: tuple[str, ...] = ()


def text_key(text: str) -> int:
    """A stable 63-bit id of a text (same in every process, unlike ``hash``), to find duplicates."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def load_sentences(sources, *, text_field: str = "text", min_words: int = 4, max_texts: int | None = None):
    """SimCSE training text: the sentences of ``sources`` (every line cut at sentence ends), in order.

    Sentences of fewer than ``min_words`` words and repeats are skipped; returns (sentences, counts).
    """
    from adapt.data import iter_documents

    seen, out, counts = set(), [], {"short": 0, "duplicate": 0}
    for doc in iter_documents(sources, text_field=text_field):
        for line in doc.text.splitlines():
            for sentence in _SENTENCE_END.split(line.strip()):
                sentence = " ".join(sentence.split())
                if not sentence:
                    continue
                if len(sentence.split()) < min_words:
                    counts["short"] += 1
                    continue
                key = text_key(sentence)
                if key in seen:
                    counts["duplicate"] += 1
                    continue
                seen.add(key)
                out.append(sentence)
                if max_texts and len(out) >= max_texts:
                    return out, counts
    return out, counts


def load_pairs(path, *, max_pairs: int | None = None):
    """Read a pairs file: one JSON object per line, ``{"query": str, "positive": str, "negatives": [str, ...]}``.

    ``negatives`` is optional (a single string is taken as one negative); other keys are ignored.
    A line that is not JSON, not an object, lacks ``query`` or ``positive``, or holds a non-text
    value raises :class:`DataError` naming ``file:line``. Documented skips, counted in the returned
    dict: lines whose query or positive is blank (``empty``), lines repeating an earlier
    (query, positive) (``duplicate``), and blank negatives or negatives equal to the positive or the
    query (``bad_negatives``). Returns (pairs, counts).
    """
    from adapt.readers import iter_records

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


# ------------------------------------------------------------------------------------ embeddings

def backbone_of(model):
    """The transformers base model (no LM head) inside a causal LM, possibly peft-wrapped."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model.base_model


class Embedder(torch.nn.Module):
    """``(input_ids, attention_mask) -> (B, H)`` fp32 pooled embeddings, as the exported encoder computes them.

    Holds the causal LM (or its peft wrapper) so that Accelerate/DDP wrap one module; the LM head is
    never run.
    """

    def __init__(self, model, pooling: str = "mean"):
        super().__init__()
        from adapt.arch import facts_for
        from adapt.export import pooling_name

        self.model = model
        self.pooling = pooling_name(pooling)
        self.absolute = facts_for(backbone_of(model).config).absolute_positions

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from adapt.bidirectional import position_ids_from_mask
        from adapt.encoder import pool

        kwargs = {"position_ids": position_ids_from_mask(attention_mask)} if self.absolute else {}
        hidden = backbone_of(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                         **kwargs).last_hidden_state  # (B, T, H)
        return pool(hidden.float(), attention_mask, self.pooling)


def tokenize(tokenizer, texts: list[str], max_length: int, device=None) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` as ``adapt.encoder`` and sentence-transformers tokenize."""
    rows = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_length,
                     return_attention_mask=False, verbose=False)["input_ids"]
    pad = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    filler = next(i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id, pad) if i is not None)
    rows = [row or [filler] for row in rows]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


_DROPOUT_ATTRS = ("attention_dropout", "attn_dropout", "dropout", "hidden_dropout", "resid_dropout")


def set_dropout(model, p: float) -> int:
    """Set every dropout of a transformers model to ``p`` (``nn.Dropout`` modules and the float
    ``attention_dropout``-like attributes attention modules read in train mode); returns how many.

    Call it before LoRA is attached: LoRA's own dropout is ``tuning.lora_dropout``.
    """
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p, n = p, n + 1
            continue
        for name in _DROPOUT_ATTRS:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, p)
                n += 1
    return n


# ---------------------------------------------------------------------------------------- losses

def info_nce(queries: torch.Tensor, docs: torch.Tensor, targets: torch.Tensor, temperature: float,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean InfoNCE of ``queries`` (Q, H) over candidate ``docs`` (D, H); ``targets`` (Q,) index each
    query's positive in ``docs``. Cosine similarity / temperature; ``mask`` (Q, D) True drops a
    candidate. Returns (loss, number of queries whose positive scores highest)."""
    logits = F.normalize(queries.float(), dim=-1) @ F.normalize(docs.float(), dim=-1).T / temperature  # (Q, D)
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    loss = F.cross_entropy(logits, targets)
    return loss, (logits.detach().argmax(dim=-1) == targets).sum()


def false_negative_mask(positive_keys: torch.Tensor, doc_keys: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(Q, D) True where a candidate is the same text as the query's positive but is not the positive itself."""
    mask = positive_keys[:, None] == doc_keys[None, :]
    mask[torch.arange(len(targets), device=mask.device), targets] = False
    return mask


def _world():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


class _GatherRows(torch.autograd.Function):
    """All-gather of rows whose backward sums the gradient over processes (an all-reduce, which every
    backend has) and returns each process the part at its own rows."""

    @staticmethod
    def forward(ctx, x, sizes: list[int], rank: int):
        import torch.distributed as dist

        padded = F.pad(x, [0, 0] * (x.dim() - 1) + [0, max(sizes) - x.shape[0]]).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded)
        ctx.sizes, ctx.rank = sizes, rank
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad)  # every process's loss may depend on these rows
        start = sum(ctx.sizes[:ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


def all_gather_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Concatenate every process's ``x`` (rows may differ in number) keeping the autograd graph: the
    gradient of a loss on the result flows back to each process's own rows (summed over processes).
    Returns (gathered, offset of this process's rows). One process: ``(x, 0)``."""
    dist, rank, world = _world()
    if dist is None:
        return x, 0
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    return _GatherRows.apply(x, sizes, rank), sum(sizes[:rank])


# ----------------------------------------------------------------------------- gradient caching

class RngState:
    """The CPU (and current CUDA device) RNG state, to replay the same dropout masks later."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    @contextlib.contextmanager
    def replay(self):
        devices = [torch.cuda.current_device()] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda)
            yield


def contrastive_backward(embed, chunks: list[dict], loss_fn, *, cache: bool, no_sync=contextlib.nullcontext,
                         backward=None):
    """Embed ``chunks`` with ``embed``, take ``loss_fn(embeddings)`` and backpropagate it into the model.

    ``cache=False``: one graph over all chunks (``backward(loss)``, default ``loss.backward()``).
    ``cache=True``: gradient caching - embed without grad, backpropagate the loss to the embeddings
    only, then re-embed chunk by chunk with grad under the replayed RNG state and backpropagate the
    cached embedding gradients; ``no_sync()`` wraps all but the last chunk (DDP syncs once).
    ``loss_fn`` returns (loss, extra); returns (loss detached, extra).
    """
    if not cache:
        loss, extra = loss_fn(torch.cat([embed(**chunk) for chunk in chunks]))
        (backward or torch.Tensor.backward)(loss)
        return loss.detach(), extra
    states, reps = [], []
    with torch.no_grad():
        for chunk in chunks:
            states.append(RngState())
            reps.append(embed(**chunk))
    cached = torch.cat(reps).requires_grad_()
    loss, extra = loss_fn(cached)
    loss.backward()  # d loss / d embeddings (and, through the gather, to the other processes' rows)
    grads = cached.grad.split([len(r) for r in reps])
    for i, (chunk, state, grad) in enumerate(zip(chunks, states, grads)):
        with (no_sync() if i < len(chunks) - 1 else contextlib.nullcontext()), state.replay():
            torch.autograd.backward(embed(**chunk), grad_tensors=grad)
    return loss.detach(), extra


# ---------------------------------------------------------------------------------------- trainer

class ContrastiveTrainer(Trainer):
    """:class:`adapt.train.Trainer` with a contrastive step: one optimizer step per batch of
    ``train.batch_size x train.grad_accum`` queries per process (grad_accum enlarges the batch through
    gradient caching instead of splitting the in-batch negatives)."""

    def __init__(self, model, *, cfg: RunConfig, run_dir: Path, tokenizer, train, eval_set, accelerator=None,
                 show_progress: bool = True):
        super().__init__(model, store=None, cfg=cfg, run_dir=run_dir, mask_token_id=None, special_ids=(),
                         vocab_size=len(tokenizer), accelerator=accelerator, show_progress=show_progress,
                         wrapper=Embedder(model, cfg.export.pooling))
        self.ccfg, self.tokenizer = cfg.contrastive, tokenizer
        self.train_set, self.eval_set = train, eval_set
        self.batch = cfg.train.batch_size * cfg.train.grad_accum
        mini = self.ccfg.mini_batch or (cfg.train.batch_size if cfg.train.grad_accum > 1 else 0)
        self.mini_batch = mini

    # ---- batches ---------------------------------------------------------------------------
    def texts(self, examples) -> tuple[list[str], int, list[int], list[int]]:
        """(texts to embed: queries then documents, number of queries, positive keys, document keys).
        Each query's positive is document ``i`` of this process (documents: positives, then negatives)."""
        c = self.ccfg
        if c.loss == "simcse":
            keys = [text_key(s) for s in examples]
            return list(examples) + list(examples), len(examples), keys, keys
        queries = [c.query_prompt + p.query for p in examples]
        docs = [p.positive for p in examples] + [n for p in examples for n in p.negatives[:c.hard_negatives]]
        positive_keys = [text_key(p.positive) for p in examples]
        return queries + [c.document_prompt + d for d in docs], len(queries), positive_keys, [text_key(d) for d in docs]

    def chunks(self, texts: list[str]) -> tuple[list[dict], torch.Tensor]:
        """Texts sorted by length cut into chunks of ``mini_batch`` (one chunk without caching), and the
        permutation that puts the chunks' embeddings back in text order."""
        lengths = [len(t) for t in texts]
        order = sorted(range(len(texts)), key=lambda i: -lengths[i])
        size = self.mini_batch or len(texts)
        dev = self.accelerator.device
        chunks = [tokenize(self.tokenizer, [texts[i] for i in order[s:s + size]], self.ccfg.max_length, dev)
                  for s in range(0, len(order), size)]
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return chunks, inverse.to(dev)

    def loss_fn(self, n_queries: int, positive_keys, doc_keys, inverse):
        dev, gather = self.accelerator.device, self.ccfg.gather

        def fn(embeddings):
            embeddings = embeddings[inverse]
            queries, docs = embeddings[:n_queries], embeddings[n_queries:]
            keys = torch.tensor(doc_keys, dtype=torch.long, device=dev)
            offset = 0
            if gather:
                docs, offset = all_gather_rows(docs)
                keys, _ = all_gather_rows(keys)
            targets = offset + torch.arange(n_queries, device=dev)
            mask = false_negative_mask(torch.tensor(positive_keys, dtype=torch.long, device=dev), keys, targets)
            return info_nce(queries, docs, targets, self.ccfg.temperature, mask)
        return fn

    # ---- Trainer hooks ---------------------------------------------------------------------
    def begin(self) -> None:
        from adapt.data import batch_iterator

        acc = self.accelerator
        self._batches = batch_iterator(np.arange(len(self.train_set)), self.batch, seed=self.tcfg.seed,
                                       start_step=self.step, rank=acc.process_index, world_size=acc.num_processes)

    def train_step(self) -> tuple[str, list[float], int]:
        acc, t = self.accelerator, self.tcfg
        examples = [self.train_set[i] for i in next(self._batches)]
        texts, n_queries, positive_keys, doc_keys = self.texts(examples)
        chunks, inverse = self.chunks(texts)
        cache = len(chunks) > 1
        loss, _ = contrastive_backward(self.wrapper, chunks, self.loss_fn(n_queries, positive_keys, doc_keys, inverse),
                                       cache=cache, no_sync=lambda: acc.no_sync(self.wrapper), backward=acc.backward)
        self.check_finite(loss, self.ccfg.loss)
        if t.max_grad_norm > 0:
            acc.clip_grad_norm_(self.wrapper.parameters(), t.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = sum(int(c["attention_mask"].sum()) for c in chunks) * acc.num_processes
        return self.ccfg.loss, [float(loss)], tokens

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss and top-1 accuracy (positive ranked first among the batch's documents), one
        process's view, no gathering. SimCSE keeps dropout on (fixed seed): identical views would make
        the task trivial."""
        if not len(self.eval_set):
            return {}
        acc, name = self.accelerator, self.ccfg.loss
        model = acc.unwrap_model(self.wrapper)
        simcse = name == "simcse"
        model.train(simcse)
        loss_sum, n_ok, n = 0.0, 0, 0
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices), acc.autocast():
            torch.manual_seed(self.tcfg.seed)
            for start in range(0, len(self.eval_set), self.tcfg.batch_size):
                examples = self.eval_set[start:start + self.tcfg.batch_size]
                texts, n_queries, positive_keys, doc_keys = self.texts(examples)
                if n_queries < 2:
                    continue
                chunks, inverse = self.chunks(texts)
                embeddings = torch.cat([model(**chunk) for chunk in chunks])
                dev = embeddings.device
                queries, docs = embeddings[inverse][:n_queries], embeddings[inverse][n_queries:]
                targets = torch.arange(n_queries, device=dev)
                mask = false_negative_mask(torch.tensor(positive_keys, device=dev), torch.tensor(doc_keys, device=dev),
                                           targets)
                loss, ok = info_nce(queries, docs, targets, self.ccfg.temperature, mask)
                loss_sum, n_ok, n = loss_sum + float(loss) * n_queries, n_ok + int(ok), n + n_queries
        model.train()
        return {f"eval/{name}_loss": loss_sum / max(n, 1), f"eval/{name}_acc": n_ok / max(n, 1)} if n else {}


# ----------------------------------------------------------------------------------------- stage

@contextlib.contextmanager
def _quiet_transformers():
    """The previous stage's export has no LM head: transformers' "newly initialized lm_head" is expected."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def data_fingerprint(examples) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for example in examples:
        digest.update(json.dumps(example if isinstance(example, str) else [example.query, example.positive,
                                                                          list(example.negatives)]).encode())
    return digest.hexdigest()


def load_training_data(cfg: RunConfig) -> tuple[list, list, dict]:
    """(train examples, held-out examples, counts) of a contrastive stage."""
    c = cfg.contrastive
    if c.loss == "pairs":
        if not c.pairs:
            raise ConfigError("a supervised contrastive stage needs pairs: pass --pairs FILE (JSON lines of "
                              '{"query": ..., "positive": ..., "negatives": [...]}) or set contrastive.pairs')
        examples, counts = load_pairs(c.pairs, max_pairs=c.max_texts)
    else:
        from adapt.convert import resolve_data_sources

        if not cfg.data.sources:
            raise ConfigError("SimCSE needs text: pass --data PATH or set data.sources for the simcse stage")
        examples, counts = load_sentences(resolve_data_sources(cfg.data.sources), text_field=cfg.data.text_field,
                                          min_words=c.min_words, max_texts=c.max_texts)
    train, held = split_eval(len(examples), cfg.data.eval_fraction, cfg.train.eval_batches * cfg.train.batch_size,
                             cfg.train.seed)
    return [examples[i] for i in train], [examples[i] for i in held], {"examples": len(examples), **counts}


def _check_batch(cfg: RunConfig, n_train: int, world: int) -> None:
    need = cfg.train.batch_size * cfg.train.grad_accum * world
    if n_train < need:
        what = "pairs" if cfg.contrastive.loss == "pairs" else "sentences"
        raise DataError(f"only {n_train} training {what}, fewer than one batch of {need} (train.batch_size x "
                        f"grad_accum x {world} processes): add data or lower train.batch_size")
    if cfg.train.batch_size * cfg.train.grad_accum < 2:
        raise ConfigError("a contrastive stage needs at least 2 queries per batch (in-batch negatives)")


def train_contrastive(cfg: RunConfig, out, *, resume: bool = False, overwrite: bool = False,
                      show_progress: bool = True, accelerator=None):
    """Run one contrastive stage into ``out`` (a normal ``adapt convert`` OUT: encoder + ``run/``)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed

    from adapt.bidirectional import assert_bidirectional
    from adapt.convert import RUN, ConvertResult, _prepare_out, _probe_saved
    from adapt.export import export_encoder
    from adapt.io_utils import atomic_write_json, atomic_write_text
    from adapt.loading import load_decoder
    from adapt.train import plot_metrics
    from adapt.tuning import apply_tuning, save_adapter_and_merge, trainable_parameters

    t0 = time.perf_counter()
    c = cfg.contrastive
    if cfg.train.mixed_precision == "fp16" and (c.mini_batch or cfg.train.grad_accum > 1):
        raise ConfigError("gradient caching (contrastive.mini_batch, train.grad_accum > 1) does not support fp16 "
                          "loss scaling: use train.mixed_precision=bf16 or no")
    out = Path(out).expanduser().resolve()
    acc = accelerator or Accelerator(mixed_precision=cfg.train.mixed_precision, project_dir=str(out / RUN))
    if acc.distributed_type == DistributedType.DEEPSPEED and (c.mini_batch or cfg.train.grad_accum > 1):
        raise ConfigError("gradient caching backpropagates outside DeepSpeed's engine: use DDP or FSDP, or set "
                          "contrastive.mini_batch=0 and train.grad_accum=1")
    train, held, counts = load_training_data(cfg)  # bad data fails before anything is written
    _check_batch(cfg, len(train), acc.num_processes)
    run_dir = out / RUN
    fingerprint = {"examples": counts["examples"], "train": data_fingerprint(train), "eval": data_fingerprint(held)}
    if acc.is_main_process:
        _prepare_out(out, cfg, resume=resume, overwrite=overwrite)
        saved = run_dir / DATA_FINGERPRINT
        if resume and saved.is_file() and json.loads(saved.read_text()) != fingerprint:
            raise DataError(f"--resume: the training data differ from the data {out} was trained on (its examples "
                            "changed); resume with the same data, or use --overwrite")
        atomic_write_text(run_dir / "config.yaml", cfg.to_yaml())
        atomic_write_json(saved, fingerprint)
    acc.wait_for_everyone()

    set_seed(cfg.train.seed)
    with _quiet_transformers():
        model, tokenizer = load_decoder(cfg.model, cfg.tuning)
    probe_before = assert_bidirectional(model, where="before contrastive training")
    dropout = c.dropout if c.dropout is not None else (0.1 if c.loss == "simcse" else None)
    n_dropouts = set_dropout(model, dropout) if dropout is not None else None
    if dropout and not n_dropouts:
        log.warning("found no dropout to set on this %s model; SimCSE views then differ only by LoRA dropout",
                    model.config.model_type)
    model = apply_tuning(model, cfg.tuning)
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is not embeddings.weight:
        head.requires_grad_(False)  # never run: an encoder stage trains the backbone only
    trainable, total = trainable_parameters(model)
    trainer = ContrastiveTrainer(model, cfg=cfg, run_dir=run_dir, tokenizer=tokenizer, train=train, eval_set=held,
                                 accelerator=acc, show_progress=show_progress)
    result = trainer.fit(resume=resume)

    summary = {}
    if acc.is_main_process:
        model = acc.unwrap_model(trainer.wrapper).model
        def load_base():
            with _quiet_transformers():
                return load_decoder(cfg.model, None)[0]

        merged = save_adapter_and_merge(model, cfg.tuning, run_dir, load_base)
        merged.eval()
        prompts = dict(cfg.export.prompts or {})
        if c.loss == "pairs" and (c.query_prompt or c.document_prompt):
            prompts.setdefault("query", c.query_prompt)
            prompts.setdefault("document", c.document_prompt)
        plot = plot_metrics(result.metrics_path, run_dir / "loss.png")
        summary = {
            "source": cfg.model.source, "model_type": merged.config.model_type,
            "loss": c.loss, "temperature": c.temperature, "dropout": dropout, "pooling": cfg.export.pooling,
            "batch_per_process": trainer.batch, "mini_batch": trainer.mini_batch, "processes": acc.num_processes,
            "data": counts, "train_examples": len(train), "eval_examples": len(held), "tuning": cfg.tuning.method,
            "trainable_parameters": trainable, "total_parameters": total, "steps": result.step,
            "tokens": result.tokens, "train_seconds": round(result.seconds, 1), "final_eval": result.last_eval,
            "probe_before": probe_before.to_dict(), "loss_plot": str(plot) if plot else None,
        }
        export_encoder(merged, tokenizer, out, pooling=cfg.export.pooling, normalize=cfg.export.normalize,
                       max_seq_length=cfg.export.max_seq_length, prompts=prompts or None, dtype=cfg.export.dtype,
                       card={**summary, "recipe": cfg.to_dict()}, source=cfg.model.source)
        summary["probe_after"] = _probe_saved(out).to_dict()
        summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
        atomic_write_json(run_dir / "summary.json", summary)
    acc.wait_for_everyone()
    return ConvertResult(out, cfg, summary)

"""SPLADE vectors from a causal LM's vocabulary logits: what training, the sparse export and its checks share.

A text's vector has one weight per vocabulary term: ``w_j = max_t log(1 + relu(logit_tj))`` over its real
tokens (SPLADE v2's max pooling), exactly what sentence-transformers' ``SpladePooling("max", "relu")``
computes on the same logits. log1p and relu are monotone, so the max is taken over the raw logits first
and only the (B, V) result goes to fp32 (no (B, T, V) fp32 copy). The FLOPS regularizer (Paria et al.,
2020) is the squared mean weight of each term over the batch, summed: it pushes rarely useful terms to 0.

A decoder's LM head has no bias and its logits are mostly positive, so ``log1p(relu)`` leaves nearly every
term active in every text. A learned per-term bias ``b`` fixes that: ``w_j = log1p(relu(max_t logit_tj +
b_j))`` (the bias commutes with the max, so it is added to the (B, V) result), started by
:func:`calibrate_term_bias` at minus each term's mean pooled logit (an IDF-like start: a term counts where a
text raises it above its usual level), shifted so that a text has about ``k`` active terms.

Inference-free queries (``splade.queries: idf``, as OpenSearch's inference-free sparse encoders): a query's
vector is the IDF of each of its tokens, no model run (sentence-transformers' ``SparseStaticEmbedding``, which
computes exactly :func:`idf_vectors`); only documents go through the model. The IDF is BM25's, counted over
the stage's training documents (:func:`idf_weights`). Byte-level BPE tokenizers spell a word differently at
the start of a text ("fox") than after a space ("Ġfox", as inside documents), so queries get a leading space
there (:func:`query_prefix`, exported as the query prompt).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adapt.model.families import facts_for
from adapt.model.bidirectional import position_ids_from_mask


def max_logits(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits under a (B, T) mask -> (B, V) fp32, each term's largest logit over the real tokens."""
    pad = ~attention_mask.bool().unsqueeze(-1)  # (B, T, 1)
    return logits.masked_fill(pad, float("-inf")).amax(dim=1).float()


def pooled_logits(logits: torch.Tensor, attention_mask: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, V) logits under a (B, T) mask -> (B, V) fp32: each term's largest logit plus its ``bias`` (V), the
    value relu cuts (a term is active where it is above 0)."""
    top = max_logits(logits, attention_mask)
    return top if bias is None else top + bias.float()


def term_weights(pooled: torch.Tensor) -> torch.Tensor:
    """SPLADE weights log1p(relu) of :func:`pooled_logits`."""
    return pooled.relu().log1p()


def splade_pool(logits: torch.Tensor, attention_mask: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, V) logits under a (B, T) mask -> (B, V) fp32 term weights, max over real tokens of log1p(relu),
    with ``bias`` (V) added to the logits first."""
    return term_weights(pooled_logits(logits, attention_mask, bias))


def calibrate_term_bias(pooled: torch.Tensor, active_terms: int) -> torch.Tensor:
    """The term bias (V) that leaves texts whose :func:`max_logits` are ``pooled`` (N, V) with ``active_terms``
    active terms on average: minus each term's mean over the texts, less the shift c that keeps the
    ``N x active_terms`` largest of the centred logits above 0."""
    pooled = pooled.float()
    centred = pooled - pooled.mean(dim=0)
    k = max(1, min(centred.numel() - 1, int(active_terms) * pooled.shape[0]))
    shift = centred.flatten().topk(k + 1).values[-2:].mean()  # between the k-th and (k+1)-th largest
    return -(pooled.mean(dim=0) + shift)


def query_prefix(tokenizer) -> str:
    """" " where the tokenizer spells a word at the start of a text with another token than after a space
    (byte-level BPE), so that a query's first word gets the id it has inside documents; "" otherwise."""
    alone = tokenizer("fox", add_special_tokens=False)["input_ids"]
    spaced = tokenizer(" fox", add_special_tokens=False)["input_ids"]
    return " " if alone != spaced and len(alone) == len(spaced) else ""


def idf_weights(tokenizer, texts: list[str], vocab: int, prefix: str = "") -> torch.Tensor:
    """BM25's IDF of every vocabulary term over ``texts`` (tokenized as the query route tokenizes them, after
    ``prefix``): log(1 + (N - df + 0.5) / (df + 0.5)); 0 for special tokens and ids the tokenizer never gives.
    A term absent from ``texts`` gets the largest weight, as BM25 gives a word seen in no document."""
    if not texts:
        raise ValueError("idf_weights needs at least one text")
    df = torch.zeros(vocab, dtype=torch.float64)
    for start in range(0, len(texts), 512):
        batch = [prefix + t for t in texts[start:start + 512]]
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            seen = sorted({i for i in ids if i < vocab})
            df[seen] += 1
    n = len(texts)
    idf = torch.log1p((n - df + 0.5) / (df + 0.5))
    idf[[i for i in tokenizer.all_special_ids if i < vocab]] = 0
    idf[len(tokenizer):] = 0
    return idf.float()


def idf_vectors(tokenizer, texts: list[str], idf: torch.Tensor, prefix: str = "", device=None,
                max_length: int | None = None) -> torch.Tensor:
    """(N, V) inference-free query vectors: each token present in ``prefix + text`` weighted by its ``idf``, as
    sentence-transformers' ``SparseStaticEmbedding`` computes them (no special tokens, truncated to
    ``max_length`` tokens, by default the tokenizer's ``model_max_length``)."""
    enc = tokenizer([prefix + t for t in texts], add_special_tokens=False, truncation=True, padding=True,
                    max_length=max_length, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    presence = torch.zeros(len(texts), idf.shape[0], dtype=torch.long).scatter_(1, ids, mask)
    return (presence * idf.detach().float().cpu()).to(device or idf.device)


def flops(weights: torch.Tensor) -> torch.Tensor:
    """FLOPS regularizer of a batch of term weights (N, V): sum over terms of the squared mean weight."""
    return weights.abs().mean(dim=0).pow(2).sum()


def regularizer_scale(step: int, warmup_steps: int) -> float:
    """SPLADE v2's quadratic warm-up of the FLOPS weights: (step / warmup)^2 until ``warmup_steps``, then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step / warmup_steps) ** 2)


def ranking_loss(queries: torch.Tensor, docs: torch.Tensor, targets: torch.Tensor,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of each query's positive among candidate ``docs`` scored by dot product (SPLADE has no
    temperature: the weights set their own scale). ``mask`` (Q, D) True drops a candidate. Returns (loss,
    number of queries whose positive scores highest)."""
    scores = queries @ docs.T  # (Q, D)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return F.cross_entropy(scores, targets), (scores.detach().argmax(dim=-1) == targets).sum()


def active_terms(weights: torch.Tensor) -> torch.Tensor:
    """Number of non-zero weights of each vector: (N, V) -> (N,)."""
    return (weights > 0).sum(dim=-1)


def keep_top_k(weights: torch.Tensor, k: int | None) -> torch.Tensor:
    """``weights`` (N, V) with all but each row's ``k`` largest set to 0 (``None``: unchanged)."""
    if not k or k >= weights.shape[-1]:
        return weights
    values, indices = weights.topk(k, dim=-1)
    return torch.zeros_like(weights).scatter(-1, indices, values)


class SparseLM(torch.nn.Module):
    """``(input_ids, attention_mask) -> (B, V)`` SPLADE weights of a causal LM (or its peft wrapper), computed as
    the exported sparse encoder computes them. Holds the model so Accelerate/DDP wrap one module, and the
    trainable ``term_bias`` (V, fp32) when given one (``raw=True``: the pooled logits, no bias nor relu), and the
    inference-free queries' ``query_idf`` (V, a buffer: checkpointed, not trained) when given one.
    ``pre_activation=True`` returns :func:`pooled_logits` (before relu; :func:`term_weights` makes them weights),
    for losses that reach inactive terms."""

    def __init__(self, model, term_bias: torch.Tensor | None = None, query_idf: torch.Tensor | None = None,
                 pre_activation: bool = False):
        super().__init__()
        self.model, self.pre_activation = model, pre_activation
        config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
        self.absolute = facts_for(config).absolute_positions
        self.term_bias = None if term_bias is None else torch.nn.Parameter(term_bias.detach().float().clone())
        self.register_buffer("query_idf", None if query_idf is None else query_idf.detach().float().clone())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, raw: bool = False) -> torch.Tensor:
        kwargs = {"position_ids": position_ids_from_mask(attention_mask)} if self.absolute else {}
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
        if raw:
            return max_logits(logits, attention_mask)
        pooled = pooled_logits(logits, attention_mask, self.term_bias)
        return pooled if self.pre_activation else term_weights(pooled)

"""InfoNCE with in-batch negatives, its cross-process gather and gradient caching.

The pieces every contrastive objective shares, kept inside the objectives layer (as
sentence-transformers keeps them inside ``CachedMultipleNegativesRankingLoss``) so that the training
loop knows nothing of them:

- :func:`info_nce`: mean InfoNCE over cosine similarities / temperature, with a candidate mask.
- :func:`matryoshka_info_nce`: InfoNCE summed (weighted) over prefixes of the embeddings (Kusupati et
  al., 2022, as sentence-transformers' ``MatryoshkaLoss``): each prefix re-normalized, so the first N
  dimensions alone are an embedding. It takes the full embeddings, so gathering and caching are unchanged.
- :func:`all_gather_rows`: every process's documents, with their gradient, so each query sees every
  process's negatives; DDP's gradient average then equals the full global-batch gradient.
- :func:`contrastive_backward`: gradient caching (Gao et al., 2021, "GradCache"): embed without grad
  in chunks, take the loss and its gradient w.r.t. the embeddings, then re-embed chunk by chunk with
  grad under the replayed RNG state (same dropout masks) and backpropagate the cached gradient, so a
  batch larger than memory trains exactly as if embedded at once.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


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


def linear_cka(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Linear CKA (Kornblith et al., 2019) between two sets of vectors of the same rows, ``x`` (N, H) and
    ``y`` (N, H'), each dimension standardized over the rows first (so a few huge dimensions, as decoders
    have, do not make the measure theirs, and what a standardized linear probe reads is what counts).
    1: the same standardized vectors up to a rotation and scale; near 0: unrelated. Differentiable in both."""
    def standardized(t):
        t = t.float() - t.float().mean(dim=0)
        return t / (t.pow(2).mean(dim=0).sqrt() + eps)

    x, y = standardized(x), standardized(y)
    k, l = x @ x.T, y @ y.T  # (N, N) Gram matrices: cheaper than H x H' for a batch
    return (k * l).sum() / (k.norm() * l.norm() + eps)


def matryoshka_sizes(dims, weights, config) -> list[tuple[int, float]]:
    """``contrastive.matryoshka_dims`` (and weights) for a model of transformers ``config`` as (size, weight)
    pairs, largest first, ``full`` being the hidden size (the pooled vector's); ConfigError, naming the key
    and the family, for a size the model does not have. ``[]`` when off."""
    from adapt.errors import ConfigError

    hidden, model = int(config.get_text_config().hidden_size), f"the {config.model_type} model's"
    sizes = [hidden if d == "full" else d for d in dims]
    for d in sizes:
        if d > hidden:
            raise ConfigError(f"contrastive.matryoshka_dims: {d} is larger than {model} hidden size {hidden}; "
                              f"list sizes up to {hidden} (or 'full')")
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"contrastive.matryoshka_dims lists {hidden} twice ('full' is {model} hidden size): "
                          f"{list(dims)}")
    pairs = zip(sizes, [float(w) for w in weights] or [1.0] * len(sizes))
    return sorted(pairs, key=lambda p: -p[0])


def matryoshka_info_nce(queries: torch.Tensor, docs: torch.Tensor, targets: torch.Tensor, temperature: float,
                        mask: torch.Tensor | None, sizes: list[tuple[int, float]]):
    """``sum(weight * info_nce(queries[:, :size], docs[:, :size]))`` over ``sizes`` ((size, weight), largest
    first; :func:`info_nce` re-normalizes each prefix). Returns (loss, {size: (its loss, detached; number of
    queries whose positive scores highest at that size)})."""
    total, per_size = 0.0, {}
    for size, weight in sizes:
        loss, correct = info_nce(queries[:, :size], docs[:, :size], targets, temperature, mask)
        total = total + weight * loss
        per_size[size] = (loss.detach(), correct)
    return total, per_size


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



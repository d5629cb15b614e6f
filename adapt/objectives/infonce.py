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
- :func:`auto_mini_batch` (``contrastive.mini_batch: auto``): how many texts a chunk holds, from
  :func:`estimate_text_bytes` (a text's training memory, from the model's shape) and :func:`free_memory`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from adapt.model.families import num_experts


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


# ------------------------------------------------------------------- how many texts a chunk holds

MEMORY_SHARE = 0.75  # mini_batch auto: the share of the free memory a step's activations may take
# peak RSS a text adds over the values its forward saves (backward's transients, allocator slack): measured 2.1 on
# SmolLM2-135M and 1.7 on a Llama-3.2-1B shape at 128 tokens (benchmarks/results/default_preset_memory.md)
ACTIVATION_FACTOR = 2.2


def estimate_text_bytes(config, *, max_length: int, element_size: float, checkpointing: bool = False,
                        lm_head: bool = False) -> int:
    """Bytes a text of ``max_length`` tokens holds from a training forward to its backward (x ACTIVATION_FACTOR): a
    layer saves about 15 x hidden + 5 x MLP width values a token under LoRA (counted with saved-tensor hooks on Llama
    shapes), + 2 x heads x length under eager attention; gradient checkpointing keeps each layer's input and one
    layer's values; ``lm_head`` (SPLADE) adds the vocabulary's logits."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
    width = int(getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", None) or 4 * hidden)
    if num_experts(text):
        width *= int(getattr(text, "num_experts_per_tok", None) or 2)
    per_layer = 15 * hidden + 5 * width
    if getattr(text, "_attn_implementation", None) == "eager":
        per_layer += 2 * int(text.num_attention_heads) * max_length
    per_token = layers * hidden + per_layer if checkpointing else layers * per_layer
    if lm_head:
        per_token += 3 * int(text.vocab_size)
    return int(max_length * per_token * element_size * ACTIVATION_FACTOR)


def auto_mini_batch(*, texts: int, per_text_bytes: int, free_bytes: int, fixed_bytes: int = 0) -> int:
    """``contrastive.mini_batch: auto``: 0 (no caching) when ``texts`` fit in :data:`MEMORY_SHARE` of
    ``free_bytes`` besides ``fixed_bytes``, else the largest power of two of texts that does (at least 1)."""
    fits = max(int((MEMORY_SHARE * free_bytes - fixed_bytes) // max(per_text_bytes, 1)), 0)
    if fits >= texts:
        return 0
    return 1 << max(fits, 1).bit_length() - 1


def free_memory(device, processes: int = 1) -> int | None:
    """Bytes free on ``device``: the GPU's, else the available RAM shared by ``processes``; None if unknown."""
    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available // max(processes, 1))

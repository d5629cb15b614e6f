"""Deterministic, resumable batches: batch k of a run is a pure function of (seed, k).

Epoch ``e`` visits the rows in the order ``np.random.default_rng([seed, e]).permutation(N)``, cut into
global batches of ``batch_size * world_size``; process ``rank`` gets its slice of each. Starting at
``start_step`` continues exactly where an interrupted run stopped. Used for packed token blocks and
for lists of contrastive examples alike. :func:`length_batches` cuts texts for inference by length.
"""
from __future__ import annotations

import math

import numpy as np

from adapt.errors import DataError


class BatchIterator:
    """An endless, deterministic, resumable sequence of batches of blocks.

    Epoch ``e`` visits the blocks in the order ``np.random.default_rng([seed, e]).permutation(N)``,
    cut into global batches of ``batch_size * world_size``; process ``rank`` gets its slice of each.
    Batch ``k`` is a pure function of ``(seed, k)`` (see :meth:`batch`), so starting at
    ``start_step`` continues exactly where an interrupted run stopped. ``.step`` is the next step.
    With ``drop_last=False`` the last global batch of an epoch may be short (split as evenly as
    possible across ranks, so a rank can get fewer rows, or none).
    """

    def __init__(self, blocks, batch_size: int, *, seed: int, start_step: int = 0, drop_last: bool = True,
                 rank: int = 0, world_size: int = 1):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size or start_step < 0:
            raise ValueError(f"bad batch layout: batch_size={batch_size}, rank={rank}, world_size={world_size}, "
                             f"start_step={start_step}")
        self.blocks, self.batch_size, self.seed = blocks, batch_size, seed
        self.rank, self.world_size, self.step = rank, world_size, start_step
        self.global_batch = batch_size * world_size
        n = len(blocks)
        self.steps_per_epoch = n // self.global_batch if drop_last else math.ceil(n / self.global_batch)
        if self.steps_per_epoch == 0:
            raise DataError(f"only {n} blocks, fewer than one global batch of {self.global_batch} "
                            f"({batch_size} per process x {world_size} processes). Add text, or lower the "
                            f"batch size or seq_len.")
        self._epoch, self._order = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks))
        return self._order

    def indices(self, step: int) -> np.ndarray:
        """The block indices of this process's part of global batch ``step``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        global_batch = self._permutation(epoch)[k * self.global_batch:(k + 1) * self.global_batch]
        return np.array_split(global_batch, self.world_size)[self.rank]

    def batch(self, step: int) -> np.ndarray:
        """This process's batch ``step``: (batch_size, seq_len) uint32."""
        return np.asarray(self.blocks[self.indices(step)])

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        out = self.batch(self.step)
        self.step += 1
        return out


def batch_iterator(blocks, batch_size: int, *, seed: int, start_step: int = 0, drop_last: bool = True,
                   rank: int = 0, world_size: int = 1) -> BatchIterator:
    """See :class:`BatchIterator`."""
    return BatchIterator(blocks, batch_size, seed=seed, start_step=start_step, drop_last=drop_last,
                         rank=rank, world_size=world_size)


def length_batches(order: list[int], lengths: list[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Inference batches (``adapt.inference.encoder``): consecutive slices of the longest-first ``order``, of ``batch_size``
    texts at most and at most ``max_tokens`` padded tokens (the first text of a slice is its longest)."""
    out, start = [], 0
    while start < len(order):
        size = max(1, min(batch_size, max_tokens // max(1, lengths[order[start]])))
        out.append(order[start:start + size])
        start += size
    return out

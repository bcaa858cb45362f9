"""Which (query, key) pairs of each ring block may attend, with packed documents, padding or a sliding window.

Ring attention's blocks (`ring_attention.py`) are cut by causality alone: rank r holds chunks r and 2c−1−r of
the row, and at step i it works on the block of rank j = (r − i) mod c:
  j == r   all its queries against its own keys, causal
  j <  r   all its queries against the block's head chunk
  j >  r   its tail-chunk queries against the whole block
With documents or a window, each of these parts also needs the element-wise rule of `paratrain.attention`
(same document, within the window), cut from the whole row's document ids by the global indices of the two
sides. A part in which no pair may attend is skipped (its K/V still travel on: other ranks need them), and
counted: packed short documents leave most far-apart chunk pairs empty.

The masks and the skip decisions are cached on the micro-batch's `Documents`, so the model's other layers
and the backward (which must skip exactly what the forward skipped) reuse them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paratrain.attention import Documents
from paratrain.parallel.cp.sharding import chunk_ids


@dataclass
class PairCounts:
    """Block parts of ring attention's forward: computed, and skipped because nothing in them may attend."""

    computed: int = 0
    skipped: int = 0


@dataclass
class RingMasks:
    """The masks of one rank's ring steps: `documents` of whole rows (or None: a window alone), ring of `size`
    ranks, this rank `rank`, chunks of `half` tokens."""

    documents: Documents | None
    window: int | None
    size: int
    rank: int
    half: int
    device: torch.device
    _own: Documents | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.documents is None:  # a window alone: one document per row
            self._own = Documents(torch.zeros(1, 2 * self.size * self.half, dtype=torch.int64, device=self.device))

    @property
    def _docs(self) -> Documents:
        return self.documents if self.documents is not None else self._own

    def indices(self, rank: int) -> torch.Tensor:
        """The global token indices rank `rank` holds, in local order: its head chunk, then its tail chunk."""
        head, tail = chunk_ids(self.size, rank)
        h = self.half
        return torch.cat([torch.arange(head * h, (head + 1) * h, device=self.device),
                          torch.arange(tail * h, (tail + 1) * h, device=self.device)])

    def part(self, block: int) -> torch.Tensor | None:
        """The mask of this rank's part of `block`'s keys (see the module docstring), or None if it is empty."""
        key = ("ring", self.size, self.rank, block, self.half)
        cache = self._docs._masks
        if key + ("empty", self.window) in cache:
            return None
        queries, keys = self.indices(self.rank), self.indices(block)
        if block < self.rank:
            keys = keys[:self.half]
        elif block > self.rank:
            queries = queries[self.half:]
        mask = self._docs.allowed(key, queries, keys, self.window)
        if not bool(mask.any()):
            cache[key + ("empty", self.window)] = True
            return None
        return mask

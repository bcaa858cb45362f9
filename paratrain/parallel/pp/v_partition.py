"""Cutting layers into the 2p chunks of a V schedule (ZB-V, DualPipeV) so that each *rank* is balanced.

    bounds = v_balanced_boundaries(weights, ranks=2)   # 5 boundaries: chunks 0..3; rank 0 holds 0 and 3

Under a V placement rank r holds chunk r and chunk 2p - 1 - r, and a micro-batch passes through both on that
rank, so a rank's work per micro-batch is the sum of its two chunks. Balancing chunks alone (the loop
placement's rule) leaves ranks unbalanced: 6 blocks with a light embedding and head cut into 4 chunks of at
most 2 blocks give rank 0 the embedding, one block, one block and the head, rank 1 four blocks. This cut
minimizes the heaviest *rank*, ties broken by the smallest sum of squared chunk weights (so a rank's two chunks
are as even as its load allows: the schedule passes through them one after the other), by dynamic programming
from the outside in: rank r takes a prefix piece and a suffix piece of what the outer ranks left, and the
innermost rank the whole middle, cut where its two chunks are most even.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from paratrain.parallel.pp.partition import PartitionError


def v_balanced_boundaries(weights: Sequence[float], ranks: int) -> list[int]:
    """Boundaries [0, b1, ..., n] of 2 * `ranks` non-empty contiguous chunks with the smallest maximum over
    ranks r of (chunk r + chunk 2p - 1 - r), then the smallest sum of squared chunk weights."""
    n, p = len(weights), ranks
    if not 1 <= 2 * p <= n:
        raise PartitionError(f"cannot cut {n} layers into the {2 * p} chunks of a V over {p} ranks: every chunk "
                             f"needs at least one layer; use fewer pipeline stages or more layers")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=np.float64))])
    solver = _solver(tuple(prefix.tolist()), min(weights) >= 0)
    bounds = [0] * (2 * p + 1)
    i, j = 0, n
    bounds[2 * p] = n
    for r in range(p - 1):
        a, b = solver.solve(p - r, i, j)[2]
        bounds[r + 1], bounds[2 * p - 1 - r] = a, b
        i, j = a, b
    # the innermost rank holds [i, j) as chunks p - 1 and p: cut where the two are most even
    bounds[p] = min(range(i + 1, j), key=lambda k: ((prefix[k] - prefix[i]) ** 2 + (prefix[j] - prefix[k]) ** 2, k))
    return bounds


@functools.lru_cache(maxsize=8)
def _solver(prefix: tuple[float, ...], prune: bool) -> _VCut:
    """One solver per weights: its sub-problems do not depend on the number of ranks (the planner asks for many)."""
    return _VCut(list(prefix), prune)


class _VCut:
    """The dynamic program of `v_balanced_boundaries`, from the outside in: `solve(k, i, j)` is (bottleneck, sum of
    squares, (a, b)) of the k innermost ranks holding the middle [i, j), the outer of them taking the prefix piece
    [i, a) and the suffix piece [b, j). Solved on demand (memoized), so only the middles the outer ranks can
    leave are visited; with non-negative weights a candidate (a, b) whose outer load exceeds a feasible
    bottleneck (plus the tie tolerance) is skipped: it can be neither the minimum nor tied with it."""

    def __init__(self, prefix: list[float], prune: bool) -> None:
        self.prefix, self.prune, self.memo = prefix, prune, {}

    def solve(self, k: int, i: int, j: int) -> tuple[float, float, tuple[int, int] | None]:
        key = (k, i, j)
        if key not in self.memo:
            self.memo[key] = self._innermost(i, j) if k == 1 else self._outer(k, i, j)
        return self.memo[key]

    def _innermost(self, i: int, j: int) -> tuple[float, float, None]:
        """The innermost rank holds the whole middle (at least two layers), cut where its chunks are most even."""
        pre = self.prefix
        total = pre[j] - pre[i]
        return total, min(left * left + (total - left) * (total - left)
                          for left in (pre[k] - pre[i] for k in range(i + 1, j))), None

    def _outer(self, k: int, i: int, j: int) -> tuple[float, float, tuple[int, int] | None]:
        pre, need = self.prefix, 2 * (k - 1)  # layers the inner ranks' chunks take at least
        if j - i < 2 + need:
            return math.inf, math.inf, None
        bound = math.inf
        if self.prune:  # a feasible cut: each piece about half this rank's share of the layers
            side = max(1, (j - i) // (2 * k))
            load = (pre[i + side] - pre[i]) + (pre[j] - pre[j - side])
            top = max(load, self.solve(k - 1, i + side, j - side)[0])
            bound = top + 1e-9 * max(1.0, abs(top))
        # the k - 1 inner ranks share the middle, so the heaviest of them holds at least its mean: a middle heavier
        # than k - 1 times the bound (and a rounding margin) cannot win either, and is never solved
        heaviest_middle = (k - 1) * bound * (1 + 1e-9) + 1e-9
        candidates = []
        for a in range(i + 1, j - need):
            first = pre[a] - pre[i]
            if first > bound:
                break  # loads only grow with a
            for b in range(j - 1, a + need - 1, -1):
                last = pre[j] - pre[b]
                load = first + last
                if load > bound:
                    break  # ... and as b moves left
                if pre[b] - pre[a] > heaviest_middle:
                    continue  # (the middle only gets lighter as b moves left)
                inner_b, inner_s, _ = self.solve(k - 1, a, b)
                if inner_b == math.inf:
                    continue
                candidates.append((a, b, max(load, inner_b), inner_s + first * first + last * last))
        if not candidates:
            return math.inf, math.inf, None
        top = min(c[2] for c in candidates)
        tied = top + 1e-9 * max(1.0, abs(top))  # sums in another order differ in the last bit
        # the first (a, then b ascending) of the ties with the smallest sum of squares
        a, b, _, s = min((c for c in candidates if c[2] <= tied), key=lambda c: (c[3], c[0], c[1]))
        return top, s, (a, b)


def rank_loads(weights: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Each rank's weight under a V placement of the chunks `bounds` cuts."""
    chunks = [sum(weights[bounds[c]:bounds[c + 1]]) for c in range(len(bounds) - 1)]
    p = len(chunks) // 2
    return [chunks[r] + chunks[2 * p - 1 - r] for r in range(p)]

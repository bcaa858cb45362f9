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
    inf = np.inf
    # (bottleneck, sum of squares) of ranks r.. given the middle [i, j) they hold; choice[r][i, j] = (a, b)
    size = n + 1
    best_b, best_s = np.full((size, size), inf), np.full((size, size), inf)
    for i in range(size):
        for j in range(i + 2, size):  # the innermost rank: the whole middle, at least two layers
            left = prefix[i + 1:j] - prefix[i]  # its first chunk [i, k) for each k
            best_b[i, j] = prefix[j] - prefix[i]
            best_s[i, j] = float((left * left + (best_b[i, j] - left) ** 2).min())
    choices: list[dict] = [{} for _ in range(p - 1)]
    for r in range(p - 2, -1, -1):
        need = 2 * (p - 1 - r)  # layers the inner ranks' chunks take at least
        new_b, new_s = np.full((size, size), inf), np.full((size, size), inf)
        for i in range(size):
            for j in range(i + 2 + need, size):
                a = np.arange(i + 1, j - 1 - need + 1)  # this rank's prefix chunk is [i, a)
                b = np.arange(i + 1 + need, j)  # ... its suffix chunk [b, j)
                first, last = (prefix[a] - prefix[i])[:, None], (prefix[j] - prefix[b])[None, :]
                load = first + last
                inner_b, inner_s = best_b[np.ix_(a, b)], best_s[np.ix_(a, b)]
                valid = (b[None, :] - a[:, None] >= need) & np.isfinite(inner_b)
                cand_b = np.where(valid, np.maximum(load, inner_b), inf)
                cand_s = np.where(valid, inner_s + first * first + last * last, inf)
                top = cand_b.min()
                if not np.isfinite(top):
                    continue
                ties = cand_b <= top + 1e-9 * max(1.0, abs(top))  # sums in another order differ in the last bit
                flat = np.where(ties, cand_s, inf).argmin()
                x, y = divmod(int(flat), len(b))
                new_b[i, j], new_s[i, j] = top, cand_s[x, y]
                choices[r][(i, j)] = (int(a[x]), int(b[y]))
        best_b, best_s = new_b, new_s
    return _bounds(choices, prefix, n, p)


def _bounds(choices: list[dict], prefix: np.ndarray, n: int, p: int) -> list[int]:
    bounds = [0] * (2 * p + 1)
    i, j = 0, n
    bounds[2 * p] = n
    for r in range(p - 1):
        a, b = choices[r][(i, j)]
        bounds[r + 1], bounds[2 * p - 1 - r] = a, b
        i, j = a, b
    # the innermost rank holds [i, j) as chunks p - 1 and p: cut where the two are most even
    bounds[p] = min(range(i + 1, j), key=lambda k: ((prefix[k] - prefix[i]) ** 2 + (prefix[j] - prefix[k]) ** 2, k))
    return bounds


def rank_loads(weights: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Each rank's weight under a V placement of the chunks `bounds` cuts."""
    chunks = [sum(weights[bounds[c]:bounds[c + 1]]) for c in range(len(bounds) - 1)]
    p = len(chunks) // 2
    return [chunks[r] + chunks[2 * p - 1 - r] for r in range(p)]

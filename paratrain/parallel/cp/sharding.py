"""The load-balanced split of the sequence over the cp axis (pure: no communication).

[Note: two mirrored chunks per rank]
Under a causal mask, query token t attends to t + 1 keys, so cutting the sequence into cp contiguous
pieces gives the last rank almost all the work and the first almost none. Instead the sequence is cut
into 2·cp equal chunks and rank r holds chunks r and 2·cp − 1 − r (a head chunk and its mirror from the
tail): every rank then holds the same number of (query, key) pairs under the mask, and every K/V block
another rank sends it is exactly half useful (see `ring_attention.py`):

    cp = 2, chunks 0 1 2 3:   rank 0 holds [0 | 3], rank 1 holds [1 | 2]
    cp = 4, chunks 0 .. 7:    rank 0 [0 | 7], rank 1 [1 | 6], rank 2 [2 | 5], rank 3 [3 | 4]

A rank's local sequence is the concatenation (head chunk, tail chunk), still in increasing position
order, so a plain causal mask over the local tokens is right for a rank's own K/V block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.errors import Error, InvalidValueError


class SequenceSplitError(Error, ValueError):
    """A sequence that cannot be split into 2·cp equal chunks."""


def check_divisible(seq_len: int, cp: int, what: str) -> None:
    if seq_len % (2 * cp):
        raise SequenceSplitError(
            f"{what}: sequence length {seq_len} is not divisible by 2 x context_parallel.size = {2 * cp} "
            f"(each cp rank holds two mirrored chunks of seq_len / {2 * cp} tokens); use a sequence length "
            f"that is a multiple of {2 * cp} (e.g. {seq_len - seq_len % (2 * cp) or 2 * cp}) or a smaller "
            f"context_parallel.size")


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that cp rank `rank` holds: (head, tail)."""
    if not 0 <= rank < cp:
        raise InvalidValueError(f"cp rank {rank} is outside an axis of size {cp}")
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global position ids of this rank's tokens, in local order: (2 · seq_len / (2 cp),)."""
    check_divisible(seq_len, cp, "context parallel split")
    chunk = seq_len // (2 * cp)
    head, tail = chunk_ids(cp, rank)
    return torch.cat([torch.arange(head * chunk, (head + 1) * chunk, device=device),
                      torch.arange(tail * chunk, (tail + 1) * chunk, device=device)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (b, s, ...) -> (b, s/cp, ...). Differentiable."""
    if cp == 1:
        return x
    dim = dim % x.dim()
    check_divisible(x.shape[dim], cp, "context parallel split")
    chunks = x.chunk(2 * cp, dim=dim)
    head, tail = chunk_ids(cp, rank)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


def merge_sequence(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of `split_sequence` given every rank's piece (in cp rank order): the full sequence."""
    cp = len(pieces)
    if cp == 1:
        return pieces[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, piece in enumerate(pieces):
        head, tail = chunk_ids(cp, rank)
        chunks[head], chunks[tail] = piece.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


@dataclass(frozen=True)
class SequenceSplit:
    """Which tokens cp rank `rank` holds, for every context-parallel method.

    ring = cp, ulysses = 1   ring attention: the mirrored chunks above
    ring = 1, ulysses = cp   Ulysses: cp contiguous pieces (each rank then attends over every token of its
                             heads, so a causal mask costs every rank the same)
    ring · ulysses = cp      USP: the mirrored chunks over the ring, each ring rank's pair cut into `ulysses`
                             contiguous parts; cp rank = ring rank · ulysses + ulysses rank
    """

    ring: int
    ulysses: int
    rank: int

    @classmethod
    def for_method(cls, method: str, cp: int, rank: int, ulysses_size: int | None = None) -> SequenceSplit:
        if method == "ring":
            return cls(cp, 1, rank)
        if method == "ulysses":
            return cls(1, cp, rank)
        if method == "usp":
            return cls(cp // ulysses_size, ulysses_size, rank)
        raise InvalidValueError(f"unknown context_parallel.method {method!r}; use 'ring', 'ulysses' or 'usp'")

    @property
    def size(self) -> int:
        return self.ring * self.ulysses

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x` along `dim`: (b, s, ...) -> (b, s/cp, ...). Differentiable."""
        if self.size == 1:
            return x
        dim = dim % x.dim()
        check_divisible(x.shape[dim], self.size, "context parallel split")
        local = split_sequence(x, self.ring, self.rank // self.ulysses, dim=dim)
        if self.ulysses > 1:
            local = local.chunk(self.ulysses, dim=dim)[self.rank % self.ulysses]
        return local

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """Global position ids of this rank's tokens, in local order: (seq_len / cp,)."""
        return self.split(torch.arange(seq_len, device=device), dim=0)

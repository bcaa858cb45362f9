"""Where Muon's matrices are, for a rank that holds only parts of them, and how it orthogonalizes them whole.

Each tensor the optimizer updates (a master) is described by a `MasterLayout`: the local parameters it covers
(`Piece`: offset in a flat buffer, local shape, placement) and, when it is one equal shard of that flat buffer
(ZeRO), the axis it is sharded over. A whole local parameter is a buffer of one piece and no axis.

[Note: one owner per matrix]
Newton-Schulz needs the whole matrix; the momentum, the weight decay and the step are element-wise and run on
whatever the rank holds. So a step (`MatrixSet.orthogonalize`) is, per master:
  1. all-gather the momentum update over the master's axis (ZeRO: every rank of it then holds the buffer);
  2. the owner of each matrix (`assign_owners`: over that axis's ranks, the largest Newton-Schulz work first to
     the least loaded rank) orthogonalizes it and writes it into a zero buffer; a matrix split over tp is first
     all-gathered over tp (every tp peer has the same owner, so they all take part), orthogonalized whole, and
     each peer keeps its own slice;
  3. reduce-scatter that buffer over the axis: each rank receives its shard of the orthogonalized updates. A
     sum of one value and zeros is that value, bit for bit.
A master without an axis (DDP, stage 0: every rank holds whole local parameters) orthogonalizes everything
itself, as one process with torch's Muon does: no extra communication, the Newton-Schulz work repeated on each
data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Placement, Shard
from paratrain.muon.newton_schulz import lr_ratio, ns_flops


@dataclass(frozen=True)
class Piece:
    """One local parameter inside a master's flat buffer."""

    offset: int
    shape: tuple[int, ...]  # local: this rank's tp slice; an expert stack is (experts here, rows, columns)
    placement: Placement

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def tp(self) -> Shard | None:
        kind = self.placement.get("tp")
        return kind if isinstance(kind, Shard) else None

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """One whole matrix's (rows, columns): the local shape's last two, with the tp-split dimension whole."""
        shape = list(self.shape)
        if self.tp is not None:
            shape[self.tp.dim] = self.tp.full
        return shape[-2], shape[-1]

    @property
    def matrices(self) -> int:
        """How many matrices the local tensor stacks (1 for a plain weight)."""
        return self.numel // (self.shape[-2] * self.shape[-1])


@dataclass(frozen=True)
class MasterLayout:
    pieces: tuple[Piece, ...]
    padded: int  # the flat buffer's length (a multiple of the axis size)
    axis: Axis | None = None  # the master is this rank's equal shard of the buffer over it; None: the whole

    @property
    def shard_numel(self) -> int:
        return self.padded // (self.axis.size if self.axis is not None else 1)

    @property
    def shard_start(self) -> int:
        return self.shard_numel * (self.axis.rank if self.axis is not None else 0)

    def lr_spans(self, adjust_lr_fn: str | None) -> list[tuple[int, int, float]]:
        """(start, end, lr ratio) of each piece's elements inside this rank's shard, in shard coordinates."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        out = []
        for piece in self.pieces:
            start, end = max(lo, piece.offset), min(hi, piece.offset + piece.numel)
            if start < end:
                out.append((start - lo, end - lo, lr_ratio(piece.matrix_shape, adjust_lr_fn)))
        return out


@dataclass
class NewtonSchulzWork:
    """What this rank has orthogonalized since the optimizer was bound (every step adds): matrices and their
    Newton-Schulz flops, which show the owners' balance."""

    matrices: int = 0
    flops: int = 0


def assign_owners(layouts: list[MasterLayout], steps: int) -> dict[tuple[int, int, int], int]:
    """{(layout index, piece index, matrix index): owner rank on the layout's axis}, balanced per axis: every
    rank of the axis computes the same table (same layouts, same order), largest work first to the least
    loaded rank (ties to the lowest rank)."""
    owners: dict[tuple[int, int, int], int] = {}
    work: dict[str, list[tuple[int, tuple[int, int, int]]]] = {}
    sizes: dict[str, int] = {}
    for li, layout in enumerate(layouts):
        if layout.axis is None or layout.axis.size == 1:
            continue
        sizes[layout.axis.name] = layout.axis.size
        for pi, piece in enumerate(layout.pieces):
            flops = ns_flops(piece.matrix_shape, steps)
            work.setdefault(layout.axis.name, []).extend((flops, (li, pi, m)) for m in range(piece.matrices))
    for name, items in work.items():
        load = [0] * sizes[name]
        for flops, key in sorted(items, key=lambda item: (-item[0], item[1])):
            owner = min(range(len(load)), key=lambda r: (load[r], r))
            owners[key] = owner
            load[owner] += flops
    return owners

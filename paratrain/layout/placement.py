"""How a parameter is laid out over the mesh: a typed record per mesh axis, written by the step that laid it
out and read by whatever needs to know (the global gradient norm, checkpoints).

    Shard(dim, full)  the ranks of the axis hold equal slices of dimension `dim` (full size `full`; the last
                      slice may reach into padding, as an uneven vocabulary does)
    Shard(dim, full, packed=(offset, whole))
                      the same, of one part of a packed tensor: the part is rows [offset, offset + full) of
                      dimension `dim` of a tensor `whole` long there (q of a fused qkv projection)
    Replicate()       every rank of the axis holds the same tensor
    Partition()       the ranks of the axis hold different parameters altogether (pipeline stages)

An axis a parameter has no record for is one its strategies never touched: it is replicated there (the
data-parallel axis of DDP, the cp axis, whose ranks see other tokens with the same weights). Data-parallel
sharding (ZeRO's flat ranges) is not a placement of a parameter: it cuts flat buffers of many parameters,
and the strategy describes it itself (`master_segments`, `grad_pieces`).

[Note: why a record on the parameter]
Strategies change modules in place and keep parameter identity (a ZeRO strategy only re-points `.data`), so
a record on the parameter follows it through every later step, whatever the parameter is then called. The
gradient norm weighs each gradient by its placements alone, without knowing which strategy split what.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

ATTRIBUTE = "_paratrain_placement"


@dataclass(frozen=True)
class Shard:
    dim: int
    full: int  # the unsplit size of `dim` (of the part, for a part of a packed tensor)
    packed: tuple[int, int] | None = None  # (the part's offset in `dim`, the packed tensor's size there)

    @property
    def whole(self) -> int:
        """The size of `dim` in the original tensor."""
        return self.packed[1] if self.packed else self.full


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class Partition:
    pass


Kind = Shard | Replicate | Partition


@dataclass(frozen=True)
class Placement:
    """The records of one tensor, axis name -> kind (hashable: strategies group gradients by it)."""

    axes: tuple[tuple[str, Kind], ...] = ()

    def get(self, axis: str) -> Kind | None:
        return dict(self.axes).get(axis)

    def with_axis(self, axis: str, kind: Kind) -> Placement:
        kept = tuple((a, k) for a, k in self.axes if a != axis)
        return Placement(tuple(sorted((*kept, (axis, kind)), key=lambda item: item[0])))

    def replicated_over(self, sizes: Mapping[str, int]) -> int:
        """How many ranks hold each element of this tensor among the axes in `sizes` (those without a record
        count as replicated): the weight 1/n makes a sum over those axes count every element once."""
        copies = 1
        for axis, size in sizes.items():
            kind = self.get(axis)
            if kind is None or isinstance(kind, Replicate):
                copies *= size
        return copies

    def __str__(self) -> str:
        return ", ".join(f"{a}: {k}" for a, k in self.axes) or "no records (replicated everywhere)"


def placement_of(tensor: torch.Tensor) -> Placement:
    return getattr(tensor, ATTRIBUTE, Placement())


def place(tensor: torch.Tensor, axis: str, kind: Kind) -> None:
    """Record that `tensor` is laid out as `kind` over `axis` (replacing an earlier record for that axis)."""
    setattr(tensor, ATTRIBUTE, placement_of(tensor).with_axis(axis, kind))

"""How a parameter is laid out over the mesh: a typed record per mesh axis, kept by the parallel model
(`Placements`), written by the step that laid the parameter out and read by whatever needs to know (the
data-parallel strategy, the global gradient norm, checkpoints).

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

[Note: why the parallel model keeps the records]
`parallelize` makes one `Placements` and hands it to every step: the tensor-parallel step records what its
layers split, expert parallelism and the pipeline split add their axes, the data-parallel strategy and the
checkpoints read it. The records are keyed by the parameter object, because strategies change modules in
place and keep parameter identity (a ZeRO strategy or a deferred allocation only re-points `.data`, or
swaps a meta parameter's contents in place), so a record follows the parameter through every later step,
whatever it is then called. A step that does replace a parameter says so (`carry`, which lets the old one
go). Nothing is written on the tensor itself, so no strategy reads another's attributes. (Not a weak
mapping: `torch.utils.swap_tensors`, which allocating a meta parameter uses, refuses tensors with weak
references.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


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


class Placements:
    """The placement records of one parallel model's parameters (see the note above)."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[torch.Tensor, Placement]] = {}  # id -> (the tensor, kept alive; its records)

    def of(self, tensor: torch.Tensor) -> Placement:
        """`tensor`'s records (none: replicated everywhere, a tensor no step laid out)."""
        found = self._records.get(id(tensor))
        return found[1] if found is not None and found[0] is tensor else Placement()

    def record(self, tensor: torch.Tensor, axis: str, kind: Kind) -> None:
        """`tensor` is laid out as `kind` over `axis` (replacing an earlier record for that axis)."""
        self._records[id(tensor)] = (tensor, self.of(tensor).with_axis(axis, kind))

    def carry(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """`new` replaces `old` in the model (a step made a new parameter): it takes over `old`'s records."""
        found = self._records.pop(id(old), None)
        if found is not None and found[0] is old:
            self._records[id(new)] = (new, found[1])

    def __len__(self) -> int:
        return len(self._records)

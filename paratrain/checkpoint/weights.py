"""Filling a parallel model's tensors from a source of whole tensors, each rank only what it keeps.

    fill_model(parallel, mesh, source)     # collective; source: a weights file (`sources.py`) or InitReplay

What a rank keeps is described as regions of the original tensors (`Region`: a flat range of a box, as
checkpoint pieces are): the fp32 masters the data-parallel strategy updates (`master_segments`) and the
module's other tensors (buffers, frozen parameters). A source writes each region from its tensor, reading
only the rows of the box the range covers (`read_box_range`); then the strategy rebuilds the parameters
from the masters (`masters_loaded`: the ZeRO-1/2 all-gather, the ZeRO-3 device shards).

[Note: no rank changes anything until every rank has checked]
A source first checks every region (names, shapes, dtypes, files); the ranks agree on the problems found,
and on the names none of them holds (a tensor of the source that the model lacks), before any region is
written, so a bad file leaves the model as it was, and the error is the same on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from paratrain.checkpoint.format import CheckpointError
from paratrain.checkpoint.pieces import model_pieces
from paratrain.comm import all_gather_object
from paratrain.layout.mesh import Mesh
from paratrain.layout.origin import Origin


class WeightsError(CheckpointError):
    """Weights that cannot fill the model: the message names the tensor and what is wrong with it."""


@dataclass
class Region:
    """Elements [start, end) of this rank's box of one original tensor (flattened), and where they go."""

    origin: Origin
    start: int
    end: int
    dest: torch.Tensor  # end - start elements: a flat view of a master shard, or of a buffer


class Source(Protocol):
    def check(self, regions: dict[str, list[Region]]) -> None: ...

    def fill(self, regions: dict[str, list[Region]]) -> list[str]: ...


def model_regions(parallel) -> dict[str, list[Region]]:
    """{original name: this rank's regions of it} (`parallel`: a ParallelModel), from the checkpoints' walk."""
    out: dict[str, list[Region]] = {}
    for piece in model_pieces(parallel):
        if piece.target is not None and not piece.target.is_contiguous():
            raise WeightsError(f"'{piece.origin.name}' is not contiguous; weights can only be filled into "
                               f"contiguous buffers")
        out.setdefault(piece.origin.name, []).append(Region(piece.origin, piece.start, piece.end, piece.data))
    return out


def read_box_range(read, shape: tuple[int, ...], origin: Origin, start: int, end: int, dtype) -> torch.Tensor:
    """Elements [start, end) of `origin`'s box (flattened) of a tensor of `shape`, from `read(index)` (a tuple
    of slices into the whole tensor). Only the rows of the box the range covers are read; the part of a box
    that reaches past the tensor (an uneven vocabulary's padding) is zeros."""
    box, offsets = origin.local_shape, origin.offsets
    if not box:  # a 0-d tensor
        return read(()).reshape(1).to(dtype)
    row = math.prod(box[1:])
    first, last = start // row, -(-end // row)  # the box's rows [first, last) hold the range
    sub = (last - first, *box[1:])
    out = torch.zeros(sub, dtype=dtype)
    lo = (offsets[0] + first, *offsets[1:])
    hi = tuple(min(lo[d] + sub[d], shape[d]) for d in range(len(shape)))
    if all(h > low for low, h in zip(lo, hi)):
        out[tuple(slice(0, h - low) for low, h in zip(lo, hi))] = read(tuple(slice(low, h) for low, h in zip(lo, hi)))
    return out.view(-1)[start - first * row:end - first * row]


def write_regions(value: torch.Tensor, regions: list[Region]) -> None:
    """Write each region from `value`, the whole tensor."""
    for r in regions:
        view = rows_view(value, r.origin, r.start, r.end)
        if view is not None:  # straight from the tensor: no buffer of the box's rows (62 MiB of a 350M Llama)
            r.dest.copy_(view)
        else:
            r.dest.copy_(read_box_range(value.__getitem__, tuple(value.shape), r.origin, r.start, r.end,
                                        r.dest.dtype))


def rows_view(value: torch.Tensor, origin: Origin, start: int, end: int) -> torch.Tensor | None:
    """Elements [start, end) of `origin`'s box as a view of `value` (the whole tensor, contiguous) when the box
    is whole rows of it inside the tensor (a ZeRO shard, a split of the first dimension); else None (a box of
    part of each row, or one reaching into padding, goes through `read_box_range`)."""
    box, offsets, shape = origin.local_shape, origin.offsets, tuple(value.shape)
    if not box or len(box) != len(shape) or tuple(box[1:]) != shape[1:] or any(offsets[1:]):
        return None
    row = math.prod(box[1:])
    if row == 0 or not value.is_contiguous():
        return None
    first, last = start // row, -(-end // row)
    if offsets[0] + last > shape[0]:
        return None
    return value[offsets[0] + first:offsets[0] + last].reshape(-1)[start - first * row:end - first * row]


def fill_model(parallel, mesh: Mesh, source: Source, strict: bool = True, names: set[str] | None = None,
               skip: set[str] = frozenset(), only: set[str] | None = None) -> None:
    """Fill every tensor this rank keeps from `source` (collective over the world), but those named in `skip`
    (adapters the source does not hold, filled otherwise), or only those named in `only` (an adapter's tensors).
    `names`: the tensors the source holds (for `strict`: any the model lacks on every rank is refused)."""
    world = mesh.world
    regions = {name: r for name, r in model_regions(parallel).items()
               if name not in skip and (only is None or name in only)}
    problem = None
    try:
        source.check(regions)
    except CheckpointError as exc:
        problem = str(exc)
    everyone = all_gather_object((problem, sorted(regions)), world, tag="weights")
    problem = next((p for p, _ in everyone if p), None)
    if problem is None and strict and names is not None:
        held = set().union(*(set(n) for _, n in everyone))
        extra = sorted(names - held)
        if extra:
            problem = (f"the weights hold {len(extra)} tensor(s) this model does not: {', '.join(extra[:8])}; map "
                       f"them to the model's names (name_map) or pass strict=False to ignore them")
    if problem:
        raise WeightsError(problem)
    missing = source.fill(regions)
    everyone = all_gather_object(missing, world, tag="weights")
    missing = sorted(set().union(*map(set, everyone)))
    if missing:
        raise WeightsError(f"{len(missing)} tensor(s) of the model were never initialized: {', '.join(missing[:8])}; "
                           f"give their modules a reset_parameters() that sets them, or pass init_fn= to "
                           f"initialize(), or load them with checkpoint.load_weights")
    parallel.grad_sync.masters_loaded()

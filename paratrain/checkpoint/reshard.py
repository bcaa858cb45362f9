"""Pieces of full tensors, and reading any region of a tensor from the pieces another layout wrote.

Every stored piece is a *flat range of a box*: a rank holds the box `full[offsets : offsets + box]` of a
tensor (tensor parallelism cuts boxes; no model parallelism means the box is the whole tensor), and of that
box, flattened row-major, it owns elements [start, end) (ZeRO cuts flat ranges; without ZeRO the range is
the whole box). A box may reach past the tensor's shape where a split dimension was padded (an uneven
vocabulary); those elements are padding and are never read back.

A loading rank needs a region of the same form (its own box and flat range). When a stored box equals the
needed box (same model-parallel layout, any data-parallel layout) it copies overlapping flat ranges; when
the boxes differ (tp changed) it assembles each stored box that intersects the needed one and copies the
intersection. Memory stays bounded by one needed box plus one stored box. This module is pure: no files,
no processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    file: str  # the safetensors file (in the tag directory) that holds it
    key: str  # its name in that file
    offsets: tuple[int, ...]
    box: tuple[int, ...]
    start: int
    end: int

    def to_json(self) -> dict:
        return {"file": self.file, "key": self.key, "offsets": list(self.offsets), "box": list(self.box),
                "start": self.start, "end": self.end}

    @classmethod
    def from_json(cls, d: dict) -> Piece:
        return cls(d["file"], d["key"], tuple(d["offsets"]), tuple(d["box"]), int(d["start"]), int(d["end"]))


# fetch(piece, lo, hi): elements [lo, hi) of the piece's stored data (1-d, relative to piece.start)
Fetch = Callable[[Piece, int, int], torch.Tensor]


def valid_count(box: tuple[int, ...], limits: tuple[int, ...], start: int, end: int) -> int:
    """How many elements with flat index in [start, end) of a row-major `box` have every coordinate below
    `limits` (i.e. are not padding)."""
    if start >= end:
        return 0
    if not box:
        return 1
    row = math.prod(box[1:])
    limit = min(limits[0], box[0])
    first, last = start // row, (end - 1) // row

    def inner(lo: int, hi: int) -> int:
        return valid_count(box[1:], limits[1:], lo, hi)

    if first == last:
        return inner(start - first * row, end - first * row) if first < limit else 0
    total = inner(start - first * row, row) if first < limit else 0
    total += max(0, min(last, limit) - (first + 1)) * inner(0, row)
    total += inner(0, end - last * row) if last < limit else 0
    return total


def limits_of(shape: tuple[int, ...], offsets: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(max(0, s - o) for s, o in zip(shape, offsets))


def coverage_problem(name: str, shape: tuple[int, ...], pieces: list[Piece]) -> str | None:
    """None if the pieces hold every element of the tensor once; else what is wrong."""
    for p in pieces:
        if len(p.offsets) != len(shape) or len(p.box) != len(shape) or not 0 <= p.start <= p.end <= math.prod(p.box):
            return f"tensor '{name}': a piece in {p.file} has coordinates that do not fit its shape {list(shape)}"
    held = sum(valid_count(p.box, limits_of(shape, p.offsets), p.start, p.end) for p in pieces)
    if held != math.prod(shape):
        return (f"tensor '{name}': its pieces hold {held} of its {math.prod(shape)} elements; the checkpoint is "
                f"incomplete")
    return None


def _intersection(shape, a_off, a_box, b_off, b_box) -> list[tuple[int, int]] | None:
    out = []
    for s, ao, ab, bo, bb in zip(shape, a_off, a_box, b_off, b_box):
        lo, hi = max(ao, bo), min(ao + ab, bo + bb, s)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return out


def pieces_needed(pieces: list[Piece], shape: tuple[int, ...], offsets: tuple[int, ...], box: tuple[int, ...],
                  start: int, end: int) -> list[Piece]:
    """The stored pieces a read of [start, end) of the box `offsets + box` touches."""
    same = [p for p in pieces if p.offsets == offsets and p.box == box]
    if same and sum(p.end - p.start for p in same) == math.prod(box):
        return [p for p in same if max(start, p.start) < min(end, p.end)]
    boxes = {(p.offsets, p.box) for p in pieces if _intersection(shape, offsets, box, p.offsets, p.box) is not None}
    return [p for p in pieces if (p.offsets, p.box) in boxes]


def read_region(pieces: list[Piece], fetch: Fetch, shape: tuple[int, ...], offsets: tuple[int, ...],
                box: tuple[int, ...], start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements [start, end) of the flattened box `full[offsets : offsets + box]`, as a new 1-d tensor of
    `dtype`; elements outside `shape` (padding) are zero."""
    needed = pieces_needed(pieces, shape, offsets, box, start, end)
    if all(p.offsets == offsets and p.box == box for p in needed):  # the same box: flat ranges only
        out = torch.zeros(end - start, dtype=dtype)
        for p in needed:
            lo, hi = max(start, p.start), min(end, p.end)
            out[lo - start:hi - start] = fetch(p, lo - p.start, hi - p.start)
        return out
    region = torch.zeros(box, dtype=dtype)
    groups: dict[tuple, list[Piece]] = {}
    for p in needed:
        groups.setdefault((p.offsets, p.box), []).append(p)
    for (s_off, s_box), group in groups.items():
        inter = _intersection(shape, offsets, box, s_off, s_box)
        whole = len(group) == 1 and group[0].start == 0 and group[0].end == math.prod(s_box)
        if whole:  # one piece is the whole stored box: read it where it is (no copy of a weight-sized piece)
            stored = fetch(group[0], 0, group[0].end)
        else:
            stored = torch.zeros(math.prod(s_box), dtype=dtype)
            for p in group:
                stored[p.start:p.end] = fetch(p, 0, p.end - p.start)
        src = stored.view(s_box)[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, s_off))]
        region[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, offsets))] = src
        del stored, src
    flat = region.reshape(-1)
    return flat if (start, end) == (0, flat.numel()) else flat[start:end].clone()  # the whole box: no second copy


def read_full(pieces: list[Piece], fetch: Fetch, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor, assembled from its pieces."""
    zeros = (0,) * len(shape)
    return read_region(pieces, fetch, shape, zeros, shape, 0, math.prod(shape), dtype).view(shape)

"""Adapters that hold no values yet, filled in any layout once the base is (collective).

    fill_adapters(parallel, mesh, adapter_tensors(model), seed)

A and B start as their names say (`paratrain.adapters.tensors.initial_value`); each rank writes the regions of
them it keeps, as any fill does. DoRA's magnitude starts as the row norms of the base weight W under it (B is
zero, so W + s·B·A = W). W is spread over the ranks in whatever pieces the layout made (tp slices of rows or
columns, ZeRO ranges, pipeline stages): each rank sums the squares of the elements of W it owns (the pieces a
checkpoint would write, each element owned by exactly one rank) into each element's output row, one
all-reduce over the world adds the ranks' sums, and the root is the norm. No rank ever holds more than its
own pieces and one vector per adapted layer.
"""

from __future__ import annotations

import math

import torch

from paratrain.adapters.tensors import AdapterTensor, initial_value
from paratrain.checkpoint.pieces import agree_on_pieces, model_pieces
from paratrain.checkpoint.weights import model_regions, write_regions
from paratrain.comm import all_reduce
from paratrain.layout.mesh import Mesh

NORM_TAG = "adapter_init"


def _row_squares(pieces: list, tensor: AdapterTensor, rows: int, device: torch.device) -> torch.Tensor:
    """Σ w² per output row over the owned pieces of the base weight (rows: its output size)."""
    out = torch.zeros(rows, dtype=torch.float64, device=device)
    for piece in pieces:
        box, offsets = piece.origin.local_shape, piece.origin.offsets
        index = torch.arange(piece.start, piece.end, device=device)
        if tensor.out_dim == 0:  # (out, in): the box's row
            row = offsets[0] + index // math.prod(box[1:])
        else:  # (in, out) (a Conv1D): the box's column
            row = offsets[1] + index % box[1]
        out.index_add_(0, row, piece.data.detach().to(device, torch.float64).pow(2))
    return out


def fill_adapters(parallel, mesh: Mesh, tensors: list[AdapterTensor], seed: int, init: str = "default") -> None:
    """Write every adapter tensor of `tensors` that this rank keeps (collective over the world), then let the
    strategy take the new values (`masters_loaded`)."""
    regions = model_regions(parallel)
    for tensor in tensors:
        if tensor.kind != "magnitude" and tensor.name in regions:
            write_regions(initial_value(tensor, seed, init), regions[tensor.name])
    magnitudes = [t for t in tensors if t.kind == "magnitude"]
    if magnitudes:
        bases = {f"model/{t.base}" for t in magnitudes}  # (only theirs: the adapters hold no values yet)
        pieces = [p for p in model_pieces(parallel) if p.key in bases]
        everyone, _ = agree_on_pieces(pieces, parallel, mesh)
        mine = [d["owned"] for d in everyone if d["rank"] == mesh.rank]
        owned = [p for p, keep in zip(pieces, mine) if keep]
        device = next((p.data.device for p in pieces), torch.device("cpu"))
        squares = torch.cat([_row_squares([p for p in owned if p.key == f"model/{t.base}"], t, t.shape[0], device)
                             for t in magnitudes])
        all_reduce(squares, mesh.world, tag=NORM_TAG)
        for tensor, norms in zip(magnitudes, squares.sqrt().split([t.shape[0] for t in magnitudes])):
            write_regions(norms.to(torch.float32).cpu(), regions.get(tensor.name, []))
    parallel.grad_sync.masters_loaded()

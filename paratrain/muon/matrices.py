"""The distributed Newton-Schulz step: gather, orthogonalize what this rank owns, scatter (see the note in
`paratrain.muon.layout`)."""

from __future__ import annotations

import torch

import paratrain.comm as comm
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Shard
from paratrain.muon.layout import MasterLayout, NewtonSchulzWork, Piece, assign_owners
from paratrain.muon.newton_schulz import muon_shape_problem, ns_flops, orthogonalize


class MatrixSet:
    """Every Muon master of one rank with its layout; `orthogonalize` runs a step's Newton-Schulz work."""

    def __init__(self, masters: list[torch.Tensor], layouts: list[MasterLayout], tp: Axis | None,
                 device: torch.device):
        for layout in layouts:
            for piece in layout.pieces:
                _check_piece(piece)
        self.index = {id(m): i for i, m in enumerate(masters)}
        self.layouts = layouts
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.device = device
        self.owners = assign_owners(layouts, steps=1)
        self.work = NewtonSchulzWork()

    def layout_of(self, master: torch.Tensor) -> MasterLayout:
        return self.layouts[self.index[id(master)]]

    def orthogonalize(self, masters: list[torch.Tensor], updates: list[torch.Tensor],
                      coefficients: tuple[float, float, float], steps: int, eps: float,
                      dtype: torch.dtype) -> list[torch.Tensor]:
        """The orthogonalized update of each master, shaped like it (every element of every matrix it holds)."""
        out = []
        for master, update in zip(masters, updates):
            li = self.index[id(master)]
            layout = self.layouts[li]
            full = self._gather(update, layout)
            # Sharded: zeros wherever another rank owns the matrix, so the reduce-scatter's sum is the owner's.
            result = torch.zeros_like(full) if layout.axis is not None else torch.empty_like(full)
            for pi, piece in enumerate(layout.pieces):
                local = full[piece.offset:piece.offset + piece.numel].view(-1, *piece.shape[-2:])
                target = result[piece.offset:piece.offset + piece.numel].view(-1, *piece.shape[-2:])
                for m in range(piece.matrices):
                    owner = self.owners.get((li, pi, m))
                    if owner is not None and owner != layout.axis.rank:
                        continue
                    whole = self._whole(local[m], piece)
                    target[m].copy_(self._mine(orthogonalize(whole, coefficients, steps, eps, dtype), piece))
                    self.work.matrices += 1
                    self.work.flops += ns_flops(piece.matrix_shape, steps)
            out.append(self._scatter(result, layout).to(master.device).view_as(master))
        return out

    def _gather(self, update: torch.Tensor, layout: MasterLayout) -> torch.Tensor:
        update = update.reshape(-1).to(self.device)
        if layout.axis is None or layout.axis.size == 1:
            return update
        full = torch.empty(layout.padded, dtype=update.dtype, device=self.device)
        comm.all_gather_into(full, update, layout.axis, tag="muon")
        return full

    def _scatter(self, result: torch.Tensor, layout: MasterLayout) -> torch.Tensor:
        if layout.axis is None or layout.axis.size == 1:
            return result
        shard = torch.empty(layout.shard_numel, dtype=result.dtype, device=self.device)
        comm.reduce_scatter_into(shard, result, layout.axis, tag="muon")
        return shard

    def _whole(self, local: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The whole matrix of which `local` is this rank's tp slice (all-gathered over tp)."""
        shard = piece.tp
        if shard is None or self.tp is None:
            return local
        dim = _matrix_dim(shard, piece)
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        comm.all_gather_list(parts, local.contiguous(), self.tp, tag="muon")
        return torch.cat(parts, dim=dim).narrow(dim, 0, shard.full)

    def _mine(self, whole: torch.Tensor, piece: Piece) -> torch.Tensor:
        """This rank's tp slice of an orthogonalized whole matrix (zeros where the slice reaches into padding)."""
        shard = piece.tp
        if shard is None or self.tp is None:
            return whole
        dim = _matrix_dim(shard, piece)
        size = piece.shape[shard.dim]
        missing = size * self.tp.size - shard.full
        if missing:
            pad = list(whole.shape)
            pad[dim] = missing
            whole = torch.cat([whole, whole.new_zeros(pad)], dim=dim)
        return whole.narrow(dim, self.tp.rank * size, size)


def _matrix_dim(shard: Shard, piece: Piece) -> int:
    """The split dimension counted in one matrix (an expert stack's leading dimension is not the matrix's)."""
    return shard.dim - (len(piece.shape) - 2)


def _check_piece(piece: Piece) -> None:
    # The engine checks the model's parameters before any collective (`engine/muon_setup.py`, which knows which
    # 3-d tensors are expert stacks); a Muon bound by hand meets this coarser check.
    problem = muon_shape_problem(piece.shape, expert_stack=True)
    if problem:
        raise InvalidValueError(f"a Muon parameter of {problem}; give it to the AdamW part (use_muon: false)")
    shard = piece.tp
    if shard is not None and shard.packed:
        raise InvalidValueError("Muon on a part of a packed projection split over tp (q, k, v in one weight): torch's "
                                "Muon orthogonalizes the packed weight as one matrix, which paratrain does not "
                                "assemble yet; give it to AdamW (optimizer.params.adamw_names) or use tp 1")
    if shard is not None and _matrix_dim(shard, piece) < 0:
        raise InvalidValueError(f"a Muon parameter of shape {tuple(piece.shape)} is split over tp along dimension "
                                f"{shard.dim}, which indexes its stacked matrices; give it to AdamW")

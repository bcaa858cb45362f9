"""The global gradient norm of any layout: one function over the gradients' placements.

    norm = global_grad_norm(grad_sync.grad_pieces(), mesh, grad_sync.axis, grad_sync.shards_gradients)

Every rank adds up the squared gradients it holds, each weighted 1/n where n ranks of the model-parallel
axes (the mesh axes outside the data-parallel one: pp, tp) hold the same elements (`Placement`); then
  1. a data-parallel strategy whose ranks hold disjoint slices (ZeRO) sums over its axis, and
  2. the sum runs over the model-parallel axes, whose ranks hold different slices or parameters.
A data-parallel strategy that replicates (DDP) holds the same averaged gradient on every rank of its axis,
so nothing is summed there. The result is the one-process norm on every rank (torchtitan's
`clip_grad_norm_` over DTensor placements plus a pipeline all-reduce is the same idea).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paratrain.comm import all_reduce
from paratrain.layout.mesh import AXES, Axis, Mesh
from paratrain.layout.placement import Placement

GradPiece = tuple[torch.Tensor, Placement]  # gradient elements, and the placement of their parameter


def model_parallel_axes(mesh: Mesh, data_parallel: Axis) -> tuple[str, ...]:
    """The mesh axes of size > 1 that the data-parallel axis does not span, outer to inner."""
    return tuple(a for a in AXES if a not in data_parallel.dims and mesh.size(a) > 1)


def local_grad_sq(pieces: Iterable[GradPiece], model_axes: dict[str, int], device: torch.device) -> torch.Tensor:
    """This rank's weighted sum of squared gradient elements (float32, on `device`, where it is reduced)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    weights: dict[Placement, float] = {}
    for grad, placement in pieces:
        if placement not in weights:
            weights[placement] = 1.0 / placement.replicated_over(model_axes)
        sq = grad.float().pow(2).sum()
        total += (sq if weights[placement] == 1.0 else sq * weights[placement]).to(device)
    return total


def global_grad_norm(pieces: Iterable[GradPiece], mesh: Mesh, data_parallel: Axis, shards_gradients: bool,
                     device: torch.device) -> torch.Tensor:
    """The L2 norm of the full gradient (collective over the world; the same number on every rank).

    With experts split over ep (folded in the data-parallel axis) the data-parallel axis is summed over too,
    as two axes: "ep", whose ranks hold different experts (and the same dense parameters), and "edp", whose
    ranks hold the same experts; a replicating strategy's pieces then weigh 1 / (ranks holding them), a
    sharding one's 1 (each element lives on one rank of the ep x edp grid)."""
    axes = model_parallel_axes(mesh, data_parallel)
    sizes = {a: mesh.size(a) for a in axes}
    experts = mesh.expert_axes()
    if experts is not None and not shards_gradients:
        ep, edp = experts
        sizes.update({"ep": ep.size, "edp": edp.size})
    local = local_grad_sq(pieces, sizes, device)
    if shards_gradients or experts is not None:
        all_reduce(local, data_parallel, tag="grad_norm")
    if axes:
        all_reduce(local, mesh.axis(axes), tag="grad_norm")
    return local.to(torch.float64).sqrt()  # a device tensor (float64, as math.sqrt of the float would be)


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that scales gradients of global norm `norm` to at most `max_norm` (1.0 when the norm is
    already below it; torch's clip_grad_norm_ rule, with its 1e-6). A device tensor: no host read."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)

"""The global gradient norm of any layout: one function over the gradients' placements.

    norm = global_grad_norm(grad_sync.grad_pieces(), mesh, device)

Every rank adds up the squared gradients it holds, each piece weighted 1/n where n ranks hold the same elements,
then one all-reduce over the world sums the weighted parts: the one-process norm on every rank. n comes from the
piece's placement alone: the world size divided by the sizes of the dims the placement splits (Shard, Partition;
Replicate or no record means every rank of that dim holds a copy). The data-parallel strategy adds its own record
to each piece (ZeRO's ranks of its dim hold disjoint slices; DDP's hold copies), so no dim is special here: a
placement on a new dim is counted like any other (torchtitan's `clip_grad_norm_` over DTensor placements is the
same idea). A placement naming a dim the mesh does not have is an error, not a silent miscount.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paratrain.comm import all_reduce
from paratrain.layout.dims import ParallelDims
from paratrain.layout.mesh import Mesh
from paratrain.layout.placement import Placement, Replicate

GradPiece = tuple[torch.Tensor, Placement]  # gradient elements, and their placement over the mesh's dims


def copies(placement: Placement, dims: ParallelDims) -> int:
    """How many ranks hold each element of a tensor placed as `placement` (its split dims must be independent:
    `ParallelDims.size` refuses dims that lie inside one another)."""
    split = [name for name, kind in placement.axes if not isinstance(kind, Replicate)]
    return dims.world_size // dims.size(split) if split else dims.world_size


def local_grad_sq(pieces: Iterable[GradPiece], dims: ParallelDims, device: torch.device) -> torch.Tensor:
    """This rank's weighted sum of squared gradient elements (float32, on `device`, where it is reduced)."""
    weights: dict[Placement, float] = {}
    by_weight: dict[float, list[torch.Tensor]] = {}
    for grad, placement in pieces:
        if placement not in weights:
            weights[placement] = 1.0 / copies(placement, dims)
        by_weight.setdefault(weights[placement], []).append(grad)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for weight, grads in by_weight.items():
        sq = _sum_of_squares(grads, device)
        total += sq if weight == 1.0 else sq * weight
    return total


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The float32 sum of squares of `grads`: one foreach norm per device and dtype (a few kernels for any
    number of tensors; float64 norms, as fast as float32 ones on a CPU, square back exactly), moved to `device`."""
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            by_device.setdefault((g.device, g.dtype), []).append(g)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tensors in by_device.values():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)  # squared back without losing digits
        total += torch.stack(norms).square().sum().to(device, torch.float32)
    return total


def global_grad_norm(pieces: Iterable[GradPiece], mesh: Mesh, device: torch.device,
                     whole_on_every_rank: bool = False) -> torch.Tensor:
    """The L2 norm of the full gradient (collective over the world; the same number on every rank).
    `whole_on_every_rank`: every rank holds the whole gradient (DDP on a world of data parallelism only), so
    the local sum is the global one and nothing is reduced."""
    if whole_on_every_rank:
        local = _sum_of_squares([grad for grad, _ in pieces], device)  # each element once: no weights
    else:
        local = local_grad_sq(pieces, mesh.dims, device)
        all_reduce(local, mesh.world, tag="grad_norm")
    return local.to(torch.float64).sqrt()  # a device tensor (float64, as math.sqrt of the float would be)


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that scales gradients of global norm `norm` to at most `max_norm` (1.0 when the norm is
    already below it; torch's clip_grad_norm_ rule, with its 1e-6). A device tensor: no host read."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


"""The gradient norm and the checkpoint's choice of writer read a tensor's own placement dims, with no per-dim
special case: placements on dims no strategy uses today (a split over dp_replicate, over USP's ring and Ulysses
dims) count every element once, summed over every simulated rank of the world."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paratrain.checkpoint.pieces import owns
from paratrain.grad_norm import copies, local_grad_sq
from paratrain.layout.dims import MeshError, ParallelDims
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Partition, Placement, Replicate, Shard


def _held(full: torch.Tensor, placement: Placement, dims: ParallelDims, rank: int) -> torch.Tensor:
    """The block of `full` a rank holds under `placement` (Shard: its coordinate's slice of the dim;
    Partition: its coordinate's tensor of a stack)."""
    coords = dims.coords(rank)
    block = full
    for name, kind in placement.axes:  # (sorted by name; the cases put a Partition's dim first)
        if isinstance(kind, Partition):  # the dim's ranks hold different tensors: index a leading dim
            block = block[coords[name]]
        elif isinstance(kind, Shard):
            block = block.chunk(dims.size(name), dim=kind.dim)[coords[name]]
    return block


def _placement(**kinds) -> Placement:
    out = Placement()
    for name, kind in kinds.items():
        out = out.with_axis(name, kind)
    return out


CASES = [
    # HSDP with tp: a tensor split over dp_shard and tp (replicated over the replicas), one split over
    # dp_replicate (a dim only HSDP made), one partitioned over the flattened dp_shard_cp, one whole everywhere
    (ParallelDims(8, dp=4, dp_replicate=2, tp=2), [
        (_placement(dp_shard=Shard(0, 4), tp=Shard(1, 6)), (4, 6), 2),
        (_placement(dp_replicate=Shard(0, 2)), (2, 5), 4),
        (_placement(dp_shard_cp=Shard(1, 4), tp=Replicate()), (3, 4), 4),
        (Placement(), (7,), 8),
    ]),
    # USP: ring and Ulysses dims inside cp, and experts: ep inside dp x cp
    (ParallelDims(16, dp=2, cp=4, cp_ulysses=2, tp=2, ep=4), [
        (_placement(cp_ring=Shard(0, 4), cp_ulysses=Shard(1, 2)), (4, 2), 4),
        (_placement(ep=Shard(0, 8), edp=Partition()), (2, 8, 3), 2),
        (_placement(cp_ulysses=Shard(0, 6)), (6,), 8),
    ]),
]


@pytest.mark.parametrize("dims,tensors", CASES)
def test_norm_counts_each_element_once_whatever_dims_hold_it(dims, tensors):
    torch.manual_seed(0)
    fulls = [torch.randn(*shape) for _, shape, _ in tensors]
    for placement, _, n in tensors:
        assert copies(placement, dims) == n, placement
    total = sum(float(local_grad_sq([(_held(full, p, dims, rank), p) for (p, _, _), full in zip(tensors, fulls)],
                                    dims, torch.device("cpu"))) for rank in range(dims.world_size))
    assert total == pytest.approx(sum(float(full.pow(2).sum()) for full in fulls), rel=1e-6)


def test_a_placement_over_nested_or_unknown_dims_is_an_error_not_a_miscount():
    dims = ParallelDims(8, dp=4, dp_replicate=2, tp=2)
    with pytest.raises(MeshError, match="overlap"):  # dp holds dp_shard: the product would count it twice
        copies(_placement(dp=Shard(0, 4), dp_shard=Shard(1, 2)), dims)
    with pytest.raises(MeshError, match="unknown mesh dim 'xp'"):
        copies(_placement(xp=Shard(0, 2)), dims)


@pytest.mark.parametrize("names", [("dp_replicate",), ("dp_shard", "tp"), ("cp_ring",), ("edp",)])
def test_exactly_one_rank_writes_each_copy_held_over_any_dims(names):
    """A checkpoint piece held as copies over `names` (the data-parallel strategy's `replicas`) is written by
    exactly one rank of each group of copies."""
    dims = ParallelDims(16, dp=2, cp=4, cp_ulysses=2, tp=2) if names == ("cp_ring",) \
        else ParallelDims(16, dp=8, dp_replicate=2, tp=2, ep=2)
    for name in ("blocks.0.attn.q.weight", "head.weight", "x"):
        origin = SimpleNamespace(name=name, replicated=())

        def writes(rank: int, origin=origin) -> bool:
            axes = []
            for dim in names:
                members = dims.group_of(rank, dim)
                axes.append(Axis(dim, tuple(members), members.index(rank), group=None))
            return owns(origin, tuple(axes), mesh=None)

        for group in dims.groups(names):
            assert sum(writes(rank) for rank in group) == 1, (name, group)

"""Catch peers that were fed different micro-batches: the ranks of one data-parallel replica (its tp, cp and pp
ranks) must all run on the same samples, and a loader seeded by the global rank silently breaks that.

    check_same_batches([batch, ...], mesh)   # collective over the world: every rank raises the same error

Each rank reduces its micro-batches to one 64-bit fingerprint (shapes, dtypes and every element of the ids,
targets, positions and documents, weighted by a fixed pseudo-random sequence so that swapped elements count, the
tensors chained in order so that swapped micro-batches count), the world all-gathers one (fingerprint, dp
coordinate) pair per rank, and every rank compares the fingerprints within each replica. All ranks see the same
gathered numbers, so they raise together, before the step's first collective could pair up wrong tensors. The
engine runs it on the first steps, or on every step with `batch_agreement: "every_step"` (a debug mode: one
all-gather of two numbers per step).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

import paratrain.comm as comm
from paratrain.data.micro_batch import MicroBatch
from paratrain.errors import Error
from paratrain.layout.mesh import Mesh

FIRST_STEPS = 1  # optimizer steps checked with batch_agreement "first_steps": the first one
_WEIGHTS: dict[int, torch.Tensor] = {}


class BatchAgreementError(Error, ValueError):
    """Ranks that must see the same micro-batch were fed different ones."""


def _weights(n: int) -> torch.Tensor:
    if n not in _WEIGHTS:
        _WEIGHTS[n] = torch.randint(1, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int64)
    return _WEIGHTS[n]


def _tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, MicroBatch):
        parts = [batch.input_ids, batch.targets, batch.position_ids,
                 None if batch.documents is None else batch.documents.ids]
        return [t for t in parts if t is not None]
    return [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]


def fingerprint(batches: list) -> int:
    """One 64-bit number for a list of micro-batches (integer arithmetic wraps the same way everywhere). Each
    tensor's elements are weighted by position, and the tensors are chained in order (total * a prime + next), so
    swapped tokens and micro-batches taken in another order count too."""
    total = torch.zeros((), dtype=torch.int64)
    for i, batch in enumerate(batches):
        for j, t in enumerate(_tensors(batch)):
            values = t.detach().cpu().reshape(-1)
            values = values.double().view(torch.int64) if values.is_floating_point() else values.long()
            total = total * 1_000_000_007 + _header(i, j, t) + (values * _weights(values.numel())).sum()
    return int(total)


def _header(i: int, j: int, t: torch.Tensor) -> int:
    """Where the tensor sits and what shape and kind it has, as a number (no str hash: it differs per process)."""
    shape = sum((k + 1) * 1_000_003 * d for k, d in enumerate(t.shape))
    return (i * 7919 + j) * 104_729 + shape + t.element_size() * 31 + int(t.is_floating_point())


def check_same_batches(batches: list, mesh: Mesh, step: int, device: torch.device | None = None) -> None:
    """Raise BatchAgreementError on every rank if the ranks of a replica hold different `batches` (collective)."""
    if mesh.dims.world_size == mesh.dims.sample_parallel_size:  # every rank is its own replica
        return
    mine = torch.tensor([fingerprint(batches), mesh.local_rank("dp")], dtype=torch.int64, device=device)
    world = mesh.world
    gathered = torch.zeros(world.size, 2, dtype=torch.int64, device=device)
    comm.all_gather_into(gathered.view(-1), mine, world, tag="batch_check")
    gathered = gathered.cpu()
    for replica in range(mesh.dims.sample_parallel_size):
        ranks = [r for r in range(world.size) if int(gathered[r, 1]) == replica]
        prints = {r: int(gathered[r, 0]) for r in ranks}
        if len(set(prints.values())) > 1:
            groups: dict[int, list[int]] = {}
            for r, value in prints.items():
                groups.setdefault(value, []).append(r)
            split = "; ".join(f"ranks {ranks_} got one" for ranks_ in groups.values())
            raise BatchAgreementError(
                f"step {step}: the ranks of data-parallel replica {replica} (ranks {ranks}: its tensor-, context- "
                f"and pipeline-parallel peers) must all be fed the same micro-batches, but they differ ({split}). "
                f"A loader seeded or sharded by the global rank does this; shard the data by the data-parallel "
                f"rank (engine.mesh.local_rank('dp') of engine.mesh.dims.sample_parallel_size), or pass "
                f"training_data= to initialize and let paratrain's loader do it")

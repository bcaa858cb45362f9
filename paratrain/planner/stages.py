"""Which blocks a pipeline rank holds, by the planner's uniform split (the engine's `partition: "uniform"`)."""

from __future__ import annotations

import functools

from paratrain.parallel.pp.v_partition import v_balanced_boundaries
from paratrain.planner.layout import V_SCHEDULES, Layout


def stage_layers(n_layer: int, stages: int) -> list[int]:
    """Blocks per pipeline stage for a uniform split: the first `n_layer % stages` stages take one more."""
    return list(_stage_layers(n_layer, stages))


@functools.lru_cache(maxsize=256)
def _stage_layers(n_layer: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(n_layer, stages)
    return tuple(base + (1 if i < extra else 0) for i in range(stages))


def rank_blocks(shape, layout: Layout, rank: int) -> int:
    """Transformer blocks a pp rank holds: `stage_layers` for the loop placement; under a V schedule those of
    its two chunks (rank and 2p - 1 - rank) in the pipeline's uniform split of the n_layer + 2 pipeline layers
    (embedding, blocks, head) into 2p chunks balanced per rank (`v_balanced_boundaries`)."""
    if layout.schedule not in V_SCHEDULES:
        return _stage_layers(shape.n_layer, layout.pp)[rank]
    return _v_blocks(shape.n_layer, layout.pp)[rank]


@functools.lru_cache(maxsize=256)
def _v_blocks(n_layer: int, pp: int) -> tuple[int, ...]:
    bounds = v_balanced_boundaries([1.0] * (n_layer + 2), pp)
    per_chunk = [len(set(range(bounds[c], bounds[c + 1])) & set(range(1, n_layer + 1))) for c in range(2 * pp)]
    return tuple(per_chunk[r] + per_chunk[2 * pp - 1 - r] for r in range(pp))

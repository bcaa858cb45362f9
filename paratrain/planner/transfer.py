"""One kind of collective a rank issues per optimizer step, as the planner counts it (`planner/comm.py`)."""

from __future__ import annotations

from dataclasses import dataclass

DP_CP = ("dp", "cp")  # the data-parallel reductions' axes


@dataclass(frozen=True)
class Transfer:
    """Collectives of one kind a rank issues per optimizer step."""

    axes: tuple[str, ...]  # mesh axes of the group
    op: str  # all_reduce | all_gather | reduce_scatter | send | recv
    elements: int  # payload elements per optimizer step (all calls together)
    element_size: int
    calls: int  # collectives per step (a bucketed reduction counts as one)
    kind: str  # what the time model overlaps it with: dp_grad, dp_param, zero3_param, tp, pp, cp, ep, scalar
    group: tuple[str, int] | None = None  # a sub-axis of `axes` (cp_ring, cp_ulysses, ep, edp): name and size

    @property
    def bytes(self) -> int:
        return self.elements * self.element_size

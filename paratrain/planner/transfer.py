"""One kind of collective a rank issues per optimizer step, as the planner counts it (`planner/comm.py`)."""

from __future__ import annotations

from dataclasses import dataclass

DP_CP = ("dp_cp",)  # the ranks that saw different tokens: DDP's reductions, the loss's
SHARD = ("dp_shard_cp",)  # ZeRO's: dp x cp, or one shard group of it under HSDP (then summed over dp_replicate)


@dataclass(frozen=True)
class Transfer:
    """Collectives of one kind a rank issues per optimizer step."""

    axes: tuple[str, ...]  # the named dims of the group (`paratrain.layout.dims`)
    op: str  # all_reduce | all_gather | reduce_scatter | send | recv
    elements: int  # payload elements per optimizer step (all calls together)
    element_size: int
    calls: int  # collectives per step (a bucketed reduction counts as one)
    kind: str  # what the time model overlaps it with: dp_grad, dp_param, zero3_param, dp_replicate, tp, pp, cp,
    # ep, scalar

    @property
    def bytes(self) -> int:
        return self.elements * self.element_size

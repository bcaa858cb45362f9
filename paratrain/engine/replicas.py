"""Replica groups, as the engine sees them: its gradient shards and the step's loss sums are summed with the same
rank of the other groups, and the step commits only when every group can (fault tolerance,
docs/fault-tolerance.md). The engine knows only this protocol; torchft lives in `paratrain.trainer.replica_groups`.

The engine's part of a step with replica groups (`OptimizerUpdate` unchanged):
  backward          ZeRO-3: each shard final in the window's last backward starts its sum over the groups
                    (final_gradient), beside the rest of the backward
  finish_gradients  the group's own reductions (reduce-scatter inside the group, HSDP's replicas inside it)
  sum_gradients     the fp32 gradient shards over the groups (in place; the rest of them, and waits for all)
  window.finish     the loss sum and the target count over the group, then over the groups (sum_counts)
  commit            the vote: False discards the step (gradients zeroed, nothing updated: `StepDiscarded`)
"""

from __future__ import annotations

from typing import Protocol

import torch

from paratrain.errors import RunError


class ReplicaGroups(Protocol):
    def final_gradient(self, index: int, tensor: torch.Tensor) -> None:
        """One gradient shard (`local_gradients()[index]`) is final while the window's last backward still runs
        (`GradSync.final_gradient_hook`): its sum over the groups may start now, beside the backward."""

    def sum_gradients(self, tensors: list[torch.Tensor]) -> None:
        """Sum this rank's gradient shards, in place, over its peers in the other replica groups of the step (the
        ones `final_gradient` started: completed)."""

    def sum_counts(self, sums: torch.Tensor) -> None:
        """Sum the step's loss sum, target count and metric sums (the group's, one vector) over the groups."""

    def commit(self) -> bool:
        """Whether the step may be applied: every group of the step reached this point without an error."""


class StepDiscarded(RunError):
    """The replica groups could not commit the step (a group failed during it): nothing was updated, the gradients
    are zeroed, and the caller redoes the step with the groups that are left."""

"""The token-weighted loss of one optimizer step: every layout trains on one process's objective.

    sum(token losses over the global batch) / count(target tokens over the global batch)

[Note: scale at the boundary, not before the first backward]
A micro-batch's loss is the mean over its own target tokens, so the engine backpropagates its sum (the mean
times its count) and learns the global count only at the accumulation boundary, in the one all-reduce of
the step over the data x context-parallel ranks, which also gives the reported loss. Gradients are linear in
the loss, so multiplying them there by `dp·cp / (count · unit)` (with the data-parallel average of the
gradients already divided by dp·cp) gives exactly the gradient of the global mean; nothing waits for a count
before the first backward starts (Megatron's per-token loss does the same). The unit keeps the
backpropagated values at the size of a mean loss (fp16's loss scale was tuned for means): it is
2^-ceil(log2(accumulation · target positions of a micro-batch)), the same on every rank (one all-reduce, the
first time), and a power of two, so it scales every gradient exactly and a resumed run, whose first
micro-batch may differ, stays bit-equal.
"""

from __future__ import annotations

import math

import torch

import paratrain.comm as comm
from paratrain.errors import InvalidValueError
from paratrain.mesh import Axis


class LossWindow:
    """The micro-batches of one accumulation window: their weighted losses and target counts (device tensors,
    summed without a host sync), and how the step divides by the global count."""

    def __init__(self, axis: Axis, device: torch.device):
        self.axis = axis  # the data x context-parallel ranks: their gradients are averaged by the strategy
        self.device = device
        self.unit: float | None = None
        self._sum = torch.zeros((), dtype=torch.float64, device=device)
        self._count = torch.zeros((), dtype=torch.float64, device=device)
        self.micro_batches = 0  # token-weighted ones in this window
        self.others = 0  # mean-averaged ones (a loss paratrain cannot weight)

    def set_unit(self, positions: int, accumulation: int) -> float:
        """The backpropagation unit (see the note), agreed once over the axis from each rank's first token
        micro-batch: `positions` target positions (b · s on this rank)."""
        if self.unit is None:
            local = torch.tensor([float(max(positions, 1) * accumulation)], dtype=torch.float64)
            comm.all_reduce(local, self.axis, op="max", tag="loss_unit")
            self.unit = 2.0 ** -math.ceil(math.log2(float(local)))
        return self.unit

    def weight(self, count: torch.Tensor) -> torch.Tensor:
        """What a micro-batch's mean loss is multiplied by before backward: its target count times the unit."""
        return count.to(torch.float32) * self.unit

    def add(self, total: torch.Tensor, count: torch.Tensor) -> None:
        """Record a micro-batch's detached loss sum and its target count."""
        if self.others:
            raise _mixed()
        self._sum += total.detach().to(torch.float64)
        self._count += count.to(torch.float64)
        self.micro_batches += 1

    def add_mean(self) -> None:
        """Record a micro-batch averaged as a mean (DeepSpeed's convention)."""
        if self.micro_batches:
            raise _mixed()
        self.others += 1

    @property
    def token_weighted(self) -> bool:
        return self.micro_batches > 0

    def finish(self) -> tuple[torch.Tensor, float]:
        """(the global token mean loss, the factor the averaged gradients are multiplied by); one all-reduce
        over the axis. Resets the window."""
        both = torch.stack([self._sum, self._count])
        comm.all_reduce(both, self.axis, tag="loss")
        total, count = both[0], both[1].clamp(min=1.0)
        grad_scale = self.axis.size / (float(count) * self.unit)
        self._sum.zero_()
        self._count.zero_()
        self.micro_batches = 0
        return (total / count).to(torch.float32), grad_scale

    def reset(self) -> None:
        self._sum.zero_()
        self._count.zero_()
        self.micro_batches = self.others = 0


def _mixed() -> InvalidValueError:
    return InvalidValueError("one accumulation window mixed token-weighted micro-batches (token data whose loss "
                             "paratrain computes) with losses it can only average: feed every micro-batch in the "
                             "same form, or set loss.reduction to \"micro_batch\"")

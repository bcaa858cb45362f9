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
from paratrain.data.micro_batch import MicroBatch, split_loss
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis


class LossWindow:
    """The micro-batches of one accumulation window: their weighted losses and target counts (device tensors,
    summed without a host sync), and how the step divides by the global count."""

    def __init__(self, axis: Axis, device: torch.device, token_loss: bool):
        self.axis = axis  # the data x context-parallel ranks: their gradients are averaged by the strategy
        self.device = device
        self.token_loss = token_loss  # "token" reduction, and the model's loss is a mean over its targets
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

    def weigh(self, loss, batch: MicroBatch | None, accumulation: int, scale_wrt_gas: bool = True
              ) -> tuple[torch.Tensor, bool]:
        """(what backward differentiates for this micro-batch, whether it is token-weighted), recorded in the
        window. `loss`: the forward's scalar or a model's (sum, count); `batch`: its token micro-batch."""
        parts = split_loss(loss)
        if parts is None and loss.dim() != 0:
            raise InvalidValueError(f"engine.backward expects a scalar loss (or a (sum, count) pair), got shape "
                                    f"{tuple(loss.shape)}; reduce it (e.g. loss.mean()) first")
        targets = batch.targets if batch is not None else None
        if parts is None and not (self.token_loss and targets is not None):
            self.add_mean()
            return (loss / accumulation if scale_wrt_gas else loss), False
        if parts is not None:  # the model's own (sum, count)
            total, count = parts
            self.set_unit(targets.numel() if targets is not None else int(count), accumulation)
            self.add(total, count)
            return total * self.unit, True
        count = batch.valid_tokens()
        self.set_unit(targets.numel(), accumulation)
        self.add(loss.detach() * count, count)
        return loss * self.weight(count), True

    def evaluate(self, loss, batch: MicroBatch | None) -> tuple[torch.Tensor, bool]:
        """(loss sum, weight) of an evaluation micro-batch and whether it is token-weighted (weight: its target
        count) rather than a mean (weight 1). Nothing is recorded."""
        parts = split_loss(loss)
        if parts is not None:
            return torch.stack([parts[0].double(), parts[1].double()]), True
        if self.token_loss and batch is not None and batch.targets is not None:
            count = batch.valid_tokens().double()
            return torch.stack([loss.double() * count, count]), True
        return torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=loss.device)]), False

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

    def finish(self, extra: torch.Tensor | None = None, across=None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the global mean loss, the factor the averaged gradients are multiplied by, `extra` summed over the
        axis: an objective's metric sums ride in the same message); one all-reduce over the axis, and with replica
        groups (`across`: `engine/replicas.py`) one sum over the groups. Resets the window."""
        both = torch.stack([self._sum, self._count])
        if extra is not None:
            both = torch.cat([both, extra.to(both.device, torch.float64)])
        comm.all_reduce(both, self.axis, tag="loss")
        if across is not None:  # every group's whole sums: the count of every row the step trained on
            across.sum_counts(both)
        total, count = both[0], both[1].clamp(min=1.0)
        grad_scale = self.axis.size / (count * self.unit)  # a device tensor: the host never reads the count
        self._sum.zero_()
        self._count.zero_()
        self.micro_batches = 0
        return (total / count).to(torch.float32), grad_scale, both[2:] if extra is not None else None

    def reset(self) -> None:
        self._sum.zero_()
        self._count.zero_()
        self.micro_batches = self.others = 0


def _mixed() -> InvalidValueError:
    return InvalidValueError("one accumulation window mixed token-weighted micro-batches (token data whose loss "
                             "paratrain computes) with losses it can only average: feed every micro-batch in the "
                             "same form, or set loss.reduction to \"micro_batch\"")


def target_positions(batch) -> int:
    """How many target positions a micro-batch has (for the backprop unit): b · s of its targets."""
    targets = batch.targets if isinstance(batch, MicroBatch) else batch[1] if isinstance(batch, (tuple, list)) \
        else None
    return targets.numel() if isinstance(targets, torch.Tensor) else 1


def mean_over_ranks(value: torch.Tensor, axis: Axis) -> torch.Tensor:
    """The mean of each rank's `value` over `axis` (the ranks' means, for a loss that is not token-weighted)."""
    comm.all_reduce(value, axis, tag="metrics")
    return value / axis.size

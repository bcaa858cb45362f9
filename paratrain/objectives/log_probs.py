"""The log-prob primitive an objective is written on: this rank's per-target log-probabilities of a micro-batch,
and the sums that make a row whole whatever split the layout made of it.

[Note: counted once, differentiated everywhere]
Under context parallelism a row's targets lie on several ranks (the cp group), each holding a chunk of its
per-token log-probs. A token-level objective (a sum over targets) needs nothing more: each rank adds its own
targets. A row-level one (DPO's pair loss of sequence log-probs, GRPO's per-sequence mean) first sums each row
over the group (`row_sum`: an all-reduce whose backward hands each chunk the row's gradient unchanged), so every
rank of the group holds the same row values and the same loss. Each rank backpropagates that loss through its own
chunk, so the gradients summed over the group are exactly the row's; but the value, and the count it is divided by,
must be counted once: `once(x)` is x on the group's first rank and x - x.detach() (zero, with x's gradient) on the
others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.comm import all_reduce, reduce_from_region
from paratrain.layout.mesh import Axis

TAG = "objective"


@dataclass
class LogProbs:
    values: torch.Tensor  # (b, s) log p(target) in fp32, 0 where there is no target
    mask: torch.Tensor  # (b, s) bool: the positions with a target
    entropy: torch.Tensor | None  # (b, s) detached, when the objective asked for it
    sequence_axis: Axis | None  # the ranks holding the other chunks of these rows (cp), None when rows are whole

    @property
    def first_in_sequence(self) -> bool:
        return self.sequence_axis is None or self.sequence_axis.rank == 0

    def row_sum(self, per_token: torch.Tensor | None = None) -> torch.Tensor:
        """(b,) the sum of `per_token` (default: the log-probs) over each whole row's targets; differentiable."""
        x = self.values if per_token is None else per_token
        rows = (x * self.mask).sum(dim=1)
        if self.sequence_axis is None:
            return rows
        return reduce_from_region(rows, self.sequence_axis, tag=TAG)

    def row_count(self) -> torch.Tensor:
        """(b,) the number of targets of each whole row (float64; no gradient)."""
        counts = self.mask.sum(dim=1).double()
        if self.sequence_axis is not None:
            all_reduce(counts, self.sequence_axis, tag=TAG)
        return counts

    def once(self, x: torch.Tensor) -> torch.Tensor:
        """A value every rank of the sequence group holds alike, counted once (the note)."""
        return x if self.first_in_sequence else x - x.detach()

    def token_sum(self, per_token: torch.Tensor) -> torch.Tensor:
        """The sum of `per_token` over this rank's targets (a token-level objective's share)."""
        return (per_token * self.mask).sum()

    def token_count(self) -> torch.Tensor:
        return self.mask.sum().double()

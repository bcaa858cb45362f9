"""What an objective is: a function of the micro-batch and its exact log-probs, returning a sum and its count.

    class MyObjective(Objective):
        def __call__(self, batch, lp):             # batch: MicroBatch, lp: LogProbs (log_probs.py)
            loss = -lp.token_sum(lp.values)          # this rank's share of the step's sum
            return Value(loss, lp.token_count())     # ... and of the count it is divided by

The engine adds every micro-batch's (sum, count) over the accumulation window and the data x context-parallel
ranks and divides once, so the objective is the one a single process computes over the whole global batch.
Metrics are (sum, count) pairs too, added the same way in the same all-reduce and logged as sum / count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paratrain.data.micro_batch import MicroBatch
from paratrain.objectives.log_probs import LogProbs


@dataclass
class Value:
    loss: torch.Tensor  # this rank's share of the step's loss sum (differentiable)
    count: torch.Tensor  # this rank's share of the count it is divided by (tokens, sequences, pairs)
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name -> (sum, count)


class Objective:
    """An objective's contract; `needs_entropy` asks the log-prob kernel for per-token entropies too."""

    name = "objective"
    uses_reference = False  # reads reference log-probs (the engine then provides them: `needs_reference`)
    needs_entropy = False
    temperature = 1.0  # the logits are divided by it before the log-probs (GRPO's sampling temperature)
    metric_names: tuple[str, ...] = ()

    def needs_reference(self, batch: MicroBatch) -> bool:
        """Whether the engine must compute reference per-target log-probs (`batch.tokens["ref_per_token_logps"]`)
        for this micro-batch before the objective runs: by default, when it uses a reference and the batch does
        not carry them."""
        return self.uses_reference and "ref_per_token_logps" not in batch.tokens

    def __call__(self, batch: MicroBatch, lp: LogProbs) -> Value:
        raise NotImplementedError


class NextToken(Objective):
    """Next-token cross-entropy on the seam: the mean of -log p over the global batch's targets (the engine's
    default loss computes the same number with the fused cross-entropy kernel)."""

    name = "sft"

    def __call__(self, batch: MicroBatch, lp: LogProbs) -> Value:
        return Value(-lp.token_sum(lp.values), lp.token_count())

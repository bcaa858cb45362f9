"""The engine's objective: the model's loss module becomes the objective's head, in every layout.

Every model family ends its forward in `loss_fn(logits, targets)` (a pipeline's last stage calls the same module);
tensor parallelism has already made it the vocabulary-parallel cross-entropy where the head is split. With an
objective other than next-token cross-entropy the engine puts an `ObjectiveHead` there: it turns this rank's logits
into exact per-target log-probs (vocabulary-parallel under tp: the full logits never exist on one rank; this rank's
sequence chunk under cp; the last stage under pp), hands them with the micro-batch in flight to the objective, and
returns the objective's (sum, count), which the loss window adds over the step and divides once
(`engine/token_loss.py`). The reference's log-probs come from the same head in capture mode, on the same split
micro-batch, before the policy's forward: with the adapters off, from a frozen copy of the initial model placed like
the model (`reference.py`), or carried by the batch.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from paratrain.data.micro_batch import IGNORE, MicroBatch, batch_in_flight
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis
from paratrain.objectives import Objective
from paratrain.objectives.grpo import REFERENCE
from paratrain.objectives.log_probs import LogProbs
from paratrain.parallel.tp.loss import VocabParallelCrossEntropy


def full_vocabulary_log_probs(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p of each target (0 where IGNORE), per-position entropy or None) from whole-vocabulary logits."""
    log_softmax = torch.log_softmax(logits.float(), dim=-1)  # (b, s, V)
    valid = targets != IGNORE
    logps = log_softmax.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~valid, 0.0)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
    return logps, entropy


class MetricSums:
    """The objective's metrics over one optimizer step, as device sums and counts (no host read until logged)."""

    def __init__(self, names: tuple[str, ...], device: torch.device):
        self.names = names
        self.sums = torch.zeros(2 * len(names), dtype=torch.float64, device=device)

    def add(self, metrics: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for i, name in enumerate(self.names):
            if name in metrics:
                total, count = metrics[name]
                self.sums[2 * i] += total.detach().double()
                self.sums[2 * i + 1] += count.detach().double()

    def take(self) -> torch.Tensor:
        """This rank's (sum, count) pairs of the step, reset for the next one."""
        out = self.sums.clone()
        self.sums.zero_()
        return out

    def values(self, reduced: torch.Tensor) -> dict[str, float]:
        """The reduced pairs as means (one host read), metrics nothing counted left out."""
        pairs = reduced.view(-1, 2).tolist()
        return {name: total / count for name, (total, count) in zip(self.names, pairs) if count > 0}


class ObjectiveHead(nn.Module):
    """In place of the model's loss module: (logits, targets) -> the objective's (sum, count) for the
    micro-batch in flight; in capture mode, the per-target log-probs written into that micro-batch."""

    def __init__(self, objective: Objective, kernel: nn.Module, sequence_axis: Axis | None, metrics: MetricSums):
        super().__init__()
        self.objective = objective
        self.vocab_parallel = kernel if isinstance(kernel, VocabParallelCrossEntropy) else None
        self.sequence_axis = sequence_axis if sequence_axis is not None and sequence_axis.size > 1 else None
        self.metrics = metrics
        self.capturing = False

    def forward(self, logits: torch.Tensor, targets: torch.Tensor):
        batch = batch_in_flight()
        if batch is None:
            raise InvalidValueError(f"the {self.objective.name} objective computes its loss from the whole "
                                    f"micro-batch: run the model through the engine (engine.train_batch, engine(...)"
                                    f" / backward / step, engine.evaluate), not module(...) directly")
        if self.objective.temperature != 1.0:
            logits = logits / self.objective.temperature
        entropy_wanted = self.objective.needs_entropy and not self.capturing
        if self.vocab_parallel is not None:
            logps, entropy = self.vocab_parallel.log_probs(logits, targets, with_entropy=entropy_wanted)
        else:
            logps, entropy = full_vocabulary_log_probs(logits, targets, entropy_wanted)
        if self.capturing:
            batch.tokens[REFERENCE] = logps.detach().double()
            zero = torch.zeros((), dtype=torch.float64, device=logps.device)
            return zero, zero
        lp = LogProbs(logps, targets != IGNORE, entropy if entropy_wanted else None, self.sequence_axis)
        value = self.objective(batch, lp)
        if torch.is_grad_enabled() or not self.training:
            self.metrics.add(value.metrics)
        return value.loss, value.count.to(torch.float64)

    @contextmanager
    def capture(self):
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False


def needs_reference(objective: Objective, batch: MicroBatch | None) -> bool:
    return batch is not None and objective.needs_reference(batch)

"""What one pipeline step carries between its actions (`runtime.py`): the micro-batches as the stages use them,
the step's activations and gradients in flight, and its losses agreed over pp; plus two small rules of the
runner (a stage's output handed to the next stage on the same rank; the actions after which a stage's
gradients are final)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import paratrain.comm as comm
from paratrain.data.micro_batch import MicroBatch
from paratrain.errors import RunError
from paratrain.parallel.pp.p2p import as_tensors
from paratrain.parallel.pp.schedules import Action, ActionKind, B, Schedule, W


@dataclass
class Micro:
    """One micro-batch as the stages use it: the first stage's input, the last stage's targets, and the token
    micro-batch (positions for the first layer, documents for every attention layer) when it is token data."""

    inputs: object
    targets: object
    batch: MicroBatch | None = None


@dataclass
class StepLoss:
    """What a pipeline step's losses add up to, the same on every pp rank: the sum of the micro-batches'
    losses and their weight (target counts when token-weighted, else the number of micro-batches)."""

    total: torch.Tensor
    weight: torch.Tensor
    token_weighted: bool
    extra: torch.Tensor | None = None  # the step's further sums (`PipelineRunner.step_extras`), summed over pp

    @property
    def mean(self) -> torch.Tensor:
        return (self.total / self.weight.clamp(min=1)).float()


@dataclass
class StepState:
    batches: list[Micro]
    training: bool
    unit: float | None = None  # token weighting: the backprop unit (paratrain.engine.token_loss); None: means
    inputs: dict = field(default_factory=dict)  # (stage, micro) -> what the stage's chunk was called with
    outputs: dict = field(default_factory=dict)  # (stage, micro) -> its output (the scaled loss on the last)
    input_grads: dict = field(default_factory=dict)  # (stage, micro) -> gradients to send back
    incoming: dict = field(default_factory=dict)  # receive action -> p2p.Incoming
    losses: list = field(default_factory=list)  # (loss sum or mean, weight, token-weighted) per micro-batch
    events: list = field(default_factory=list)  # (kind, stage, micro, start, end), wall-clock seconds
    peak_in_flight: int = 0  # most micro-batch stages holding activations at once

    def leftovers(self) -> list[str]:
        held = {"inputs": self.inputs, "outputs": self.outputs, "input_grads": self.input_grads,
                "incoming": self.incoming}
        return [f"{name}: {sorted(map(str, value))}" for name, value in held.items() if value]


def agree_losses(losses: list, axis, device: torch.device, token_weighted: bool | None,
                 extra: torch.Tensor | None = None) -> StepLoss:
    """The step's losses on every pp rank: one all-reduce of (sum, weight, token-weighted, mixed) from the last
    stage (the other stages add zeros); a step that mixed the two kinds fails on every rank at once.
    `token_weighted`: the kind an earlier step read (None: read it now, on the host); a later step asserts on
    the device that it held, so it reads nothing back."""
    kinds = {token for _, _, token in losses}  # empty unless this rank holds the last stage
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for value, weight, _ in losses:
        sums += torch.stack([value.detach().double(), weight.detach().double().to(device)])
    flags = torch.tensor([float(True in kinds), float(len(kinds) > 1)], dtype=torch.float64)
    both = torch.cat([sums, flags.to(device), *([] if extra is None else [extra.to(device, torch.float64)])])
    comm.all_reduce(both, axis, tag="metrics")
    if token_weighted is None:
        if both[3] > 0:
            raise mixed_losses()
        token_weighted = bool(both[2] > 0)
    else:
        try:  # no host read: an accelerator asserts on the device
            torch._assert_async((both[3] == 0) & ((both[2] > 0) == token_weighted), str(mixed_losses()))
        except RuntimeError:
            raise mixed_losses() from None
    return StepLoss(both[0], both[1], token_weighted, both[4:] if extra is not None else None)


def handed_over(value, training: bool):
    """A stage's output as the next stage's input on the same rank: detached (each stage's backward stops at
    its input, as across ranks), floating tensors requiring grad so the input gradient is computed."""
    tensors = [t.detach().requires_grad_() if training and t.is_floating_point() else t.detach()
               for t in as_tensors(value)]
    return tuple(tensors) if isinstance(value, (tuple, list)) else tensors[0]


def last_gradient_actions(schedule: Schedule, rank: int) -> set[Action]:
    """The actions after which a stage's parameters hold their last gradient contribution of the step:
    per stage, its last B, and with a split backward also its last W."""
    last: dict[tuple[ActionKind, int], Action] = {}
    for a in schedule.actions[rank]:
        if a.kind in (B, W):
            last[(a.kind, a.stage)] = a
    return set(last.values())


def mixed_losses() -> RunError:
    return RunError("a pipeline step mixed token-weighted losses with losses it can only average: feed every "
                    "micro-batch in one form, or set loss.reduction to \"micro_batch\"")

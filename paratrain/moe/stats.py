"""Per-step routing metrics of the `MoELayer`s of a model: what every training forward of a step routed.

    totals = take_routing(model)                 # per layer: the step's running totals, reset (no host sync)
    step = reduce_routing(totals, mesh.axis("dp_cp"))   # one all_reduce (tag "metrics"), one host copy
    step.layers["model.layers.0.mlp"].counts      # choices routed to each expert over the step, all ranks
    step.dropped_fraction, step.aux_loss, step.load_max, step.load_min

Each training forward of a `MoELayer` adds its counts, dropped choices and losses to `layer.step_totals`
(`record_forward`), on the device, so gradient accumulation's and a pipeline's micro-batches all count and a
forward costs no host sync for them. Not
counted: forwards in eval mode, and the recompute of activation checkpointing (it runs inside backward; the
forward it repeats was counted). `layer.last` still describes the last forward alone.

With expert parallelism each rank routes its own tokens: the counts and dropped choices are summed over the
data x context-parallel ranks, the losses averaged over every forward of every rank. `reduce_routing` is a
collective: every rank of the axis calls it at the same steps, with the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.comm import all_reduce
from paratrain.layout.mesh import Axis


class RoutedLayer(nn.Module):
    """A layer whose training forwards record their routing in `step_totals` (`record_forward`): `MoELayer`.
    The metrics find such layers by this base, so this module needs nothing from the layer's own module."""

    step_totals: StepTotals | None
    num_experts: int


@dataclass
class StepTotals:
    """Running totals of one layer's training forwards since the last `take_routing`."""

    counts: torch.Tensor  # (E,) int64: choices routed to each expert, before capacity
    dropped: torch.Tensor  # int64 scalar: choices beyond capacity
    aux_loss: torch.Tensor  # float32 scalar: the sum of the forwards' balancing losses
    z_loss: torch.Tensor  # float32 scalar: ... and of their z-losses
    forwards: int


@dataclass
class LayerRouting:
    """One layer's routing over a step (all ranks of the reduction)."""

    counts: list[int]  # choices routed to each expert: sums to tokens x top_k
    dropped: int
    aux_loss: float  # mean over the step's forwards
    z_loss: float
    forwards: int

    @property
    def load(self) -> tuple[float, float]:
        """(max, min) of count / mean count over the experts; (1, 1) before any token."""
        mean = sum(self.counts) / len(self.counts)
        return (max(self.counts) / mean, min(self.counts) / mean) if mean else (1.0, 1.0)


@dataclass
class RoutingStep:
    """Every MoE layer's routing over one optimizer step, by module name."""

    layers: dict[str, LayerRouting]

    @property
    def dropped_fraction(self) -> float:
        routed = sum(sum(layer.counts) for layer in self.layers.values())
        return sum(layer.dropped for layer in self.layers.values()) / routed if routed else 0.0

    @property
    def aux_loss(self) -> float:
        """Mean over the layers (the model's coefficients are not known here)."""
        return sum(layer.aux_loss for layer in self.layers.values()) / len(self.layers)

    @property
    def z_loss(self) -> float:
        return sum(layer.z_loss for layer in self.layers.values()) / len(self.layers)

    @property
    def load_max(self) -> float:
        """The most loaded expert of any layer: its count / its layer's mean count."""
        return max(layer.load[0] for layer in self.layers.values())

    @property
    def load_min(self) -> float:
        return min(layer.load[1] for layer in self.layers.values())

    def scalars(self) -> dict[str, float]:
        return {"moe_dropped_fraction": self.dropped_fraction, "moe_aux_loss": self.aux_loss,
                "moe_z_loss": self.z_loss, "moe_load_max": self.load_max, "moe_load_min": self.load_min}

    def row(self) -> dict:
        """The scalars and, per layer, the tokens of each expert and the dropped choices (a metrics row)."""
        return {**self.scalars(), "moe_tokens": {name: layer.counts for name, layer in self.layers.items()},
                "moe_dropped": {name: layer.dropped for name, layer in self.layers.items()}}


def record_forward(layer: nn.Module, counts: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor,
                   z: torch.Tensor) -> None:
    """Add one forward's routing to `layer.step_totals` (training forwards only, not a recompute)."""
    if not layer.training or _in_backward():
        return
    totals = layer.step_totals
    if totals is None:
        layer.step_totals = StepTotals(counts.detach().clone(), dropped.clone(), aux.detach().float().clone(),
                                       z.detach().float().clone(), 1)
        return
    totals.counts += counts.detach()
    totals.aux_loss += aux.detach().float()
    totals.z_loss += z.detach().float()
    totals.dropped += dropped
    totals.forwards += 1


def _in_backward() -> bool:
    """True inside autograd's backward: activation checkpointing recomputing a forward."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def moe_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every `MoELayer` (every `RoutedLayer`) in `module`, in module order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, RoutedLayer)]


def take_routing(module: nn.Module) -> dict[str, StepTotals]:
    """Every MoE layer's totals since the last call, and reset them (zeros, on the layer's device, for a layer
    without a training forward: every rank then reduces the same layers)."""
    totals = {}
    for name, layer in moe_layers(module):
        if layer.step_totals is None:
            device = layer.gate.gate.weight.device
            zero = torch.zeros((), dtype=torch.float32, device=device)
            layer.step_totals = StepTotals(torch.zeros(layer.num_experts, dtype=torch.int64, device=device),
                                           torch.zeros((), dtype=torch.int64, device=device), zero, zero.clone(), 0)
        totals[name], layer.step_totals = layer.step_totals, None
    return totals


def reduce_routing(totals: dict[str, StepTotals], axis: Axis | None = None) -> RoutingStep:
    """Sum counts, dropped choices, losses and forwards over `axis` (None: this rank alone) with one
    all_reduce, in float64 (counts stay exact below 2^53), and copy the result to the host once."""
    if not totals:
        return RoutingStep({})
    parts = []
    for t in totals.values():
        device = t.counts.device
        parts += [t.counts.to(torch.float64), torch.stack([t.aux_loss, t.z_loss]).to(torch.float64),
                  torch.stack([t.dropped.to(device=device, dtype=torch.float64),
                               torch.tensor(float(t.forwards), dtype=torch.float64).to(device)])]
    flat = torch.cat(parts)
    if axis is not None:
        all_reduce(flat, axis, tag="metrics")
    values, layers, at = flat.tolist(), {}, 0
    for name, t in totals.items():
        size = t.counts.numel()
        counts, (aux, z, dropped, forwards) = values[at:at + size], values[at + size:at + size + 4]
        at += size + 4
        n = max(int(forwards), 1)
        layers[name] = LayerRouting([int(c) for c in counts], int(dropped), aux / n, z / n, int(forwards))
    return RoutingStep(layers)


def collect_routing(module: nn.Module, axis: Axis | None = None) -> RoutingStep | None:
    """`take_routing` then `reduce_routing` (a collective when `axis` is given); None without MoE layers."""
    totals = take_routing(module)
    return reduce_routing(totals, axis) if totals else None

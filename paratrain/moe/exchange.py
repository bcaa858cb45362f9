"""Expert parallelism inside a mixture-of-experts layer: token rows to the ranks that hold their experts and
back, by two uneven all-to-alls around the local experts' batched compute.

With the experts split over the `ep` ranks of an expert group (rank r holds experts [r·E/ep, (r+1)·E/ep)),
one layer's forward on each rank is

    counts   (E,) kept choices per expert, all-to-all'd (ep, E/ep) -> what each rank sends me per expert
    dispatch rows of the kept choices, sorted by expert, sent to the owner of their expert   [ep_dispatch]
    compute  received rows regrouped into (E/ep, C_max, d): one batched matmul per projection
    combine  each row's output back to the rank it came from, in the order it was sent       [ep_combine]
    sum      weighted, into each token (paratrain.moe.dispatch.combine's rule)

Backward runs both exchanges again in the other direction under the same tags (`exchange_rows`), so per step
and layer the elements that leave a rank are 2·d·(rows it sends to other ranks + rows it receives from them)
(`Exchange.leaving` gives the two row counts of one forward, which `MoEStats` keeps).

A rank whose experts receive no rows still joins every all-to-all (its counts say 0) and still runs its
experts, on a single zero row, so its expert parameters take part in every backward and every gradient
reduction: nothing waits for a rank that had nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.comm import all_to_all_into, exchange_rows
from paratrain.layout.mesh import Axis
from paratrain.moe.dispatch import DispatchPlan


@dataclass(frozen=True)
class ExpertGroup:
    """Where a layer's experts live: this rank holds experts [first, first + local) of `total`, and the ranks
    of `axis` (the ep group) hold the others, in rank order."""

    axis: Axis
    total: int

    @property
    def local(self) -> int:
        return self.total // self.axis.size

    @property
    def first(self) -> int:
        return self.axis.rank * self.local


@dataclass
class ExpertLayer:
    """What expert parallelism needs of one mixture-of-experts layer, whatever its family: how many experts it
    has, where its stacked expert parameters are (each (E, ...) along dim 0, as `(owner module, attribute)`),
    and what to tell the layer once this rank keeps experts [group.first, group.first + group.local) only
    (`assign(group)`: it then routes through `expert_parallel_rows`). paratrain's `MoELayer`, DeepSpeed's
    `deepspeed.moe.layer.MoE` and Hugging Face MoE blocks each describe themselves with one."""

    num_experts: int
    stacked: list[tuple[nn.Module, str]] = field(default_factory=list)
    assign: Callable[[ExpertGroup], None] = lambda group: None


def expert_layers_of(module: nn.Module) -> list[tuple[str, ExpertLayer]]:
    """(name, ExpertLayer) of every module of `module` that describes itself (`expert_layer()`), in order."""
    return [(name, m.expert_layer()) for name, m in module.named_modules()
            if callable(getattr(m, "expert_layer", None))]


@dataclass
class Exchange:
    """One forward's row counts: sent per destination rank, received per (source rank, local expert)."""

    send_rows: list[int]
    recv_counts: torch.Tensor  # (ep, E_local) int64

    def __post_init__(self) -> None:
        self.recv_rows: list[int] = self.recv_counts.sum(1).tolist()

    def leaving(self, rank: int) -> tuple[int, int]:
        """(rows sent to other ranks, rows received from other ranks): what crosses the links."""
        return sum(self.send_rows) - self.send_rows[rank], sum(self.recv_rows) - self.recv_rows[rank]


def exchange_counts(plan: DispatchPlan, group: ExpertGroup) -> Exchange:
    """Tell every rank of the group how many rows it will receive from this rank for each of its experts."""
    kept = torch.bincount(plan.expert, minlength=group.total).view(group.axis.size, group.local)
    received = torch.empty_like(kept)
    all_to_all_into(received, kept.contiguous(), group.axis, tag="ep_counts")
    return Exchange(kept.sum(1).tolist(), received)


def _received_positions(recv_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For the received rows (in (source, local expert) blocks): each row's local expert, its position among
    that expert's rows (sources in rank order), and the largest number of rows of one expert."""
    sources, local = recv_counts.shape
    flat = recv_counts.reshape(-1)
    device = recv_counts.device
    expert_of_row = torch.arange(local, device=device).repeat(sources).repeat_interleave(flat)
    block_start = torch.cumsum(flat, 0) - flat
    within_block = torch.arange(int(flat.sum()), device=device) - block_start.repeat_interleave(flat)
    before_source = (torch.cumsum(recv_counts, 0) - recv_counts).reshape(-1)  # rows of earlier sources
    position = before_source.repeat_interleave(flat) + within_block
    widest = max(int(recv_counts.sum(0).max()), 1) if recv_counts.numel() else 1
    return expert_of_row, position, widest


def expert_parallel_rows(x: torch.Tensor, plan: DispatchPlan, experts: nn.Module,
                         group: ExpertGroup) -> tuple[torch.Tensor, Exchange]:
    """The experts' output row of every kept choice of `plan` (in the plan's order), computed by the ranks
    that hold the experts, and the forward's row counts. x (T, d) is this rank's tokens."""
    exchange = exchange_counts(plan, group)
    rows = x.index_select(0, plan.token)  # sorted by expert: destination ranks in order
    received = exchange_rows(rows, exchange.send_rows, exchange.recv_rows, group.axis, tag="ep_dispatch")
    expert_of_row, position, widest = _received_positions(exchange.recv_counts)
    slot = expert_of_row * widest + position
    d = x.shape[-1]
    buffer = received.new_zeros(group.local * widest, d).index_copy(0, slot, received)
    out = experts(buffer.view(group.local, widest, d))
    out_rows = out.reshape(group.local * widest, -1).index_select(0, slot)
    back = exchange_rows(out_rows, exchange.recv_rows, exchange.send_rows, group.axis, tag="ep_combine")
    return back, exchange

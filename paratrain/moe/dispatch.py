"""Dispatch and combine: the two halves of a mixture-of-experts layer around the experts' compute.

    plan = plan_dispatch(routing.experts, routing.weights, num_experts, capacity)   # who goes where
    buffer = dispatch(x, plan)          # (E, C, d): token rows in per-expert buffers, zero padding after them
    y = combine(experts(buffer), plan)  # (T, d): each token's kept choices, weighted and summed

They are separate functions so expert parallelism can put an all-to-all between them: the (E, C, d) buffer
splits along E into one block per ep rank (dispatch's all-to-all sends block r to rank r, combine's sends
them back), and nothing in the plan but `slot` refers to positions in the buffer.

Capacity: each expert takes at most C of the choices routed to it, in priority order (token order unless an
`order` is given: DeepSpeed's top-2 puts every first choice before any second one); the rest are dropped, and
contribute 0 (the block's residual carries the token). `capacity=None` is dropless: C = the largest count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paratrain.errors import InvalidValueError


@dataclass
class DispatchPlan:
    """Where each kept (token, choice) goes: row `slot` (= e·C + position) of the (E·C, d) buffer."""

    num_experts: int
    capacity: int  # C: rows per expert in the buffer (all groups' capacity rows)
    num_tokens: int
    token: torch.Tensor  # (A,) int64: the token of each kept choice
    choice: torch.Tensor  # (A,) int64: its flat index t·k + j in the routing's (T, k)
    slot: torch.Tensor  # (A,) int64: its row in the flattened buffer
    weight: torch.Tensor  # (A,): its combine weight (differentiable)
    counts: torch.Tensor  # (E,) int64: choices routed to each expert, before dropping
    dropped: torch.Tensor  # int64 scalar: choices beyond their expert's capacity (on the device: no host read)
    dropped_tokens: torch.Tensor  # int64 scalar: tokens all of whose choices were dropped (the residual carries them)
    expert: torch.Tensor | None = None  # (A,) int64: the expert of each kept choice (non-decreasing)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float | None,
                    min_capacity: int = 0) -> int | None:
    """ceil(k · T / E · capacity_factor), at least `min_capacity`; None (dropless) when the factor is None."""
    if capacity_factor is None:
        return None
    if capacity_factor <= 0:
        raise InvalidValueError(f"capacity_factor = {capacity_factor}: it must be > 0 (1.0 fits a perfectly "
                                f"balanced routing), or None for dropless routing")
    return max(math.ceil(top_k * num_tokens / num_experts * capacity_factor), min_capacity)


def plan_dispatch(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None,
                  order: torch.Tensor | None = None, group_size: int | None = None) -> DispatchPlan:
    """The plan for `experts`/`weights` (T, k). `order`: a permutation of the T·k flat choices (index t·k + j)
    giving their priority for the capacity (default: token order, a token's choices best first).
    `group_size`: the capacity holds per run of that many consecutive tokens (GShard's groups: each group
    fills its own C rows of every expert), so what is dropped depends on a group's tokens only; None: one
    group of all T tokens. The kept choices come out sorted by expert (then group, then priority)."""
    tokens, k = experts.shape
    group_size = tokens if group_size is None or capacity is None else group_size
    if tokens % group_size:
        raise InvalidValueError(f"router group size {group_size} does not divide the {tokens} tokens of this "
                                f"forward; use a group size that divides each rank's tokens per sequence")
    groups = tokens // group_size
    device = experts.device
    flat_expert = experts.reshape(-1)
    flat_token = torch.arange(tokens, device=device).repeat_interleave(k)
    flat_weight, flat_choice = weights.reshape(-1), torch.arange(tokens * k, device=device)
    if order is not None:
        flat_expert, flat_token, flat_weight, flat_choice = (t[order] for t in (flat_expert, flat_token, flat_weight,
                                                                                 flat_choice))
    counts = torch.bincount(flat_expert, minlength=num_experts)
    # one bucket per (expert, group); a stable sort keeps each bucket's choices in priority order, so a
    # choice's position is its rank within its bucket
    bucket = flat_expert * groups + torch.div(flat_token, group_size, rounding_mode="floor")
    sizes = torch.bincount(bucket, minlength=num_experts * groups)
    by_bucket = torch.argsort(bucket, stable=True)
    starts = torch.cumsum(sizes, 0) - sizes
    position = torch.arange(by_bucket.numel(), device=device) - starts[bucket[by_bucket]]
    cap = max(int(sizes.max()), 1) if capacity is None else capacity
    keep = position < cap
    kept = by_bucket[keep]
    token = flat_token[kept]
    carried = torch.zeros(tokens, dtype=torch.bool, device=device)
    carried[token] = True
    # row in the (E, groups·C, d) buffer: expert e's rows are its groups' C rows one after the other
    slot = bucket[kept] * cap + position[keep]
    return DispatchPlan(num_experts=num_experts, capacity=cap * groups, num_tokens=tokens, token=token,
                        choice=flat_choice[kept], slot=slot, weight=flat_weight[kept], counts=counts,
                        dropped=(~keep).sum(), dropped_tokens=(~carried).sum(),
                        expert=flat_expert[kept])


def dispatch(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """x (T, d) -> (E, C, d): each kept choice's token row at its slot, zeros in the unused rows."""
    rows = plan.num_experts * plan.capacity
    buffer = x.new_zeros(rows, x.shape[-1]).index_copy(0, plan.slot, x.index_select(0, plan.token))
    return buffer.view(plan.num_experts, plan.capacity, x.shape[-1])


def combine(expert_out: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """(E, C, d) -> (T, d): Σ over each token's kept choices of weight · its expert's row."""
    return combine_rows(expert_out.reshape(-1, expert_out.shape[-1]).index_select(0, plan.slot), plan)


def combine_rows(rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """(A, d) expert outputs of the kept choices (in the plan's order) -> (T, d): Σ weight · row per token. The
    weighted sum is accumulated in the weights' dtype (float32), as bf16 sums of k rows would lose precision,
    then cast back."""
    weighted = rows.to(plan.weight.dtype) * plan.weight.unsqueeze(-1)
    out = weighted.new_zeros(plan.num_tokens, rows.shape[-1]).index_add(0, plan.token, weighted)
    return out.to(rows.dtype)

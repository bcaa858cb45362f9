"""`MoELayer`: router -> dispatch -> grouped SwiGLU experts -> combine (+ an always-on shared expert).

    moe = MoELayer(d_model=64, num_experts=8, d_ff=128, top_k=2, capacity_factor=None, shared_experts=1)
    out = moe(x)                        # x (..., d): out.output (..., d), out.aux_loss, out.z_loss (scalars)
    loss = task_loss + aux_coef * out.aux_loss + z_coef * out.z_loss
    moe.last.counts, moe.last.dropped   # what the last forward routed: per-expert counts, dropped choices

The layer returns its losses rather than adding them anywhere, so the model decides their coefficients (see
`router.load_balancing_loss` and `router.router_z_loss` for the exact formulas). Expert parallelism
(`paratrain.parallel.ep.split`, through `expert_layer()`) keeps a slice of `experts` along dim 0 and puts the
all-to-alls of `paratrain/moe/exchange.py` between `dispatch` and `combine`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from paratrain.comm import reduce_from_region
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis
from paratrain.moe.dispatch import DispatchPlan, combine, combine_rows, dispatch, expert_capacity, plan_dispatch
from paratrain.moe.exchange import ExpertGroup, ExpertLayer, expert_parallel_rows
from paratrain.moe.experts import GroupedSwiGLU, SwiGLU
from paratrain.moe.router import Router, load_balancing_loss, router_z_loss
from paratrain.moe.stats import RoutedLayer, StepTotals, record_forward


class MoEOutput(NamedTuple):
    output: torch.Tensor  # the input's shape
    aux_loss: torch.Tensor  # float32 scalar: load_balancing_loss of this forward's routing
    z_loss: torch.Tensor  # float32 scalar: router_z_loss of this forward's logits


class MoEStats:
    """What the last forward routed (detached, for metrics). The scalars stay on the device until read: a
    forward costs no host sync for them."""

    def __init__(self, counts: torch.Tensor, dropped: torch.Tensor, dropped_tokens: torch.Tensor, capacity: int,
                 aux_loss: torch.Tensor, z_loss: torch.Tensor, rows_sent: int = 0, rows_received: int = 0):
        self.counts = counts  # (E,) int64: choices routed to each expert, before capacity
        self.capacity = capacity  # rows per expert in the dispatch buffer
        self.rows_sent, self.rows_received = rows_sent, rows_received  # ep: token rows to/from other ranks
        self._scalars = (dropped, dropped_tokens, aux_loss, z_loss)

    @property
    def dropped(self) -> int:
        """Choices beyond their expert's capacity (0 when dropless)."""
        return int(self._scalars[0])

    @property
    def dropped_tokens(self) -> int:
        """Tokens all of whose choices were dropped."""
        return int(self._scalars[1])

    @property
    def aux_loss(self) -> float:
        return float(self._scalars[2])

    @property
    def z_loss(self) -> float:
        return float(self._scalars[3])


class MoELayer(RoutedLayer):
    """A mixture of `num_experts` SwiGLU experts of width `d_ff`, each token sent to its `top_k` best.

    `capacity_factor`: None routes dropless; a number caps each expert at ceil(k·G/E·factor) choices per
    group of G tokens (`group_size`; None: G = the tokens of the forward), dropping the rest in token order.
    The balancing loss is computed per group too and averaged, so with a group size that divides each rank's
    tokens of a sequence every layout routes, drops and balances exactly as one process does.
    `shared_experts`: that many always-on experts of width `shared_d_ff` (default `d_ff`), computed as one
    dense SwiGLU of width shared_experts · shared_d_ff and added to the routed output (DeepSeek's shared experts)."""

    def __init__(self, d_model: int, num_experts: int, d_ff: int, top_k: int = 2, *, score_func: str = "softmax",
                 norm_topk_prob: bool = True, capacity_factor: float | None = None, shared_experts: int = 0,
                 shared_d_ff: int = 0, router_bias: bool = False, group_size: int | None = None):
        super().__init__()
        if shared_experts < 0:
            raise InvalidValueError(f"shared_experts = {shared_experts}: use 0 (none) or a positive count")
        expert_capacity(1, top_k, num_experts, capacity_factor)  # refuses a bad factor at construction
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.group_size = group_size
        # set by expert parallelism (paratrain.parallel.ep.split): which of the experts this rank holds
        self.expert_parallel: ExpertGroup | None = None
        self.token_axes: list[Axis] = []  # axes whose ranks route other tokens of the same groups' sequences
        self.gate = Router(d_model, num_experts, top_k, score_func, norm_topk_prob, bias=router_bias)
        self.experts = GroupedSwiGLU(num_experts, d_model, d_ff)
        width = shared_experts * (shared_d_ff or d_ff)
        self.shared_experts = SwiGLU(d_model, width) if shared_experts else None
        self.last: MoEStats | None = None
        self.step_totals: StepTotals | None = None  # this step's training forwards (stats.take_routing resets)

    def expert_layer(self) -> ExpertLayer:
        """For expert parallelism: the three stacked (E, ...) projections of `experts` and their adapters'."""
        return ExpertLayer(self.num_experts, self.experts.stacked_parameters(), self._keep_experts)

    def _keep_experts(self, group: ExpertGroup) -> None:
        self.experts.num_experts = group.local
        self.expert_parallel = group

    def split_tokens_over(self, axis: Axis) -> None:
        """Sequence parallelism runs this layer on the s/tp tokens of each rank: the balancing and z losses,
        means over tokens, become means over the axis too (the ranks' losses are one loss, not tp copies)."""
        self.token_axes.append(axis)

    def _mean_over_token_axes(self, loss: torch.Tensor) -> torch.Tensor:
        for axis in self.token_axes:  # forward: the mean over the axis; backward: each rank's share, 1/size
            loss = reduce_from_region(loss / axis.size, axis, tag="moe_loss")
        return loss

    def routing_group(self, shape: torch.Size) -> int:
        """Tokens per routing group for an input of `shape` ((b, s, d) or (T, d)): `group_size`, or a whole
        (shorter) sequence when the group is longer than it."""
        tokens = shape[:-1].numel()
        if self.group_size is None:
            return tokens
        seq = shape[-2] if len(shape) > 2 else tokens
        if seq % self.group_size == 0:
            return self.group_size
        if self.group_size > seq and len(shape) > 2:
            return seq
        raise InvalidValueError(f"MoE group_size {self.group_size} does not divide the {seq} tokens of each "
                                f"sequence of this forward; use a group size that divides each rank's tokens "
                                f"per sequence")

    def plan(self, x: torch.Tensor, group: int | None = None) -> tuple[DispatchPlan, torch.Tensor, torch.Tensor]:
        """Route x (T, d) in groups of `group` tokens (None: all T): the dispatch plan, the balancing loss and
        the z-loss."""
        routing = self.gate(x)
        group = group or x.shape[0]
        capacity = expert_capacity(group, self.top_k, self.num_experts, self.capacity_factor)
        plan = plan_dispatch(routing.experts, routing.weights, self.num_experts, capacity, group_size=group)
        aux = load_balancing_loss(routing.probs, routing.experts, self.num_experts, group_size=group)
        return plan, aux, router_z_loss(routing.logits)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        shape = x.shape
        flat = x.reshape(-1, self.d_model)  # (T, d)
        plan, aux, z = self.plan(flat, self.routing_group(shape))
        aux, z = self._mean_over_token_axes(aux), self._mean_over_token_axes(z)
        sent = received = 0
        if self.expert_parallel is None:
            out = combine(self.experts(dispatch(flat, plan)), plan)
        else:
            rows, exchange = expert_parallel_rows(flat, plan, self.experts, self.expert_parallel)
            out = combine_rows(rows, plan)
            sent, received = exchange.leaving(self.expert_parallel.axis.rank)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        record_forward(self, plan.counts, plan.dropped, aux, z)
        self.last = MoEStats(counts=plan.counts.detach(), dropped=plan.dropped, dropped_tokens=plan.dropped_tokens,
                             capacity=plan.capacity, aux_loss=aux.detach(), z_loss=z.detach(),
                             rows_sent=sent, rows_received=received)
        return MoEOutput(out.reshape(shape), aux, z)

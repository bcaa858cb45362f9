"""DeepSpeed's `deepspeed.moe.layer.MoE`, for `import paratrain as deepspeed`: same arguments, same
(output, l_aux, exp_counts), DeepSpeed's top-1 / top-2 gating (GShard), computed with paratrain's dispatch,
batched experts and combine. `ep_size > 1` splits the experts over paratrain's one expert-parallel axis
(`paratrain.parallel.ep.split`, through `MOELayer.expert_layer()`): the layers' ep_size becomes the config's
`expert_parallel.size` (`expert_parallel_size_of`), and each rank keeps E/ep_size experts.

What DeepSpeed's gating does, and so this one (written from DeepSpeed's documentation and code, not copied):
  logits = x W_g in float32 (`noisy_gate_policy="Jitter"`: x times U(1-0.01, 1+0.01) noise while training);
  gates = softmax(logits); S tokens, E experts.
  top-1: expert = argmax(gates) (`"RSample"`: argmax(logits + Gumbel noise) while training), weight = its gate
         (not renormalised); capacity = max(ceil(S/E · factor), min_capacity); which tokens an over-full
         expert keeps is random with `use_rts` (random token selection), token order without.
  top-2: first = argmax(gates), second = argmax over the others of logits (+ Gumbel noise when
         `top2_2nd_expert_sampling`, training or not, as DeepSpeed); capacity = max(ceil(S/E · 2·factor),
         min_capacity); every first choice is placed before any second one; the kept choices' gates are
         renormalised to sum 1 per token (a token whose second choice was dropped gets weight 1 on its first).
  `drop_tokens=False`: capacity = the largest count (nothing dropped). `factor` is `capacity_factor` in
  training, `eval_capacity_factor` in eval.
  l_aux = E · Σ_e mean_s(gates[s, e]) · (fraction of tokens whose *first* choice is e), for k = 1 and 2.
  exp_counts (E,): choices routed to each expert before dropping (first choices for k = 1, both for k = 2).
  With experts split over ep ranks the gating stays per rank, on its own tokens, as DeepSpeed's does: the
  capacity, l_aux and exp_counts (all E experts) are those of the rank's tokens; only the expert compute moves.
Parameter names differ from DeepSpeed's (`deepspeed_moe.experts.weights.i` holds all experts' Linear i).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import InvalidValueError
from paratrain.moe.dispatch import combine, combine_rows, dispatch, expert_capacity, plan_dispatch
from paratrain.moe.exchange import ExpertGroup, ExpertLayer, expert_parallel_rows
from paratrain.moe.experts import StackedMLP

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


def _gumbel(like: torch.Tensor) -> torch.Tensor:
    uniform = torch.rand_like(like).clamp_(torch.finfo(like.dtype).tiny, 1.0)
    return -torch.log(-torch.log(uniform))


class TopKGate(nn.Module):
    """DeepSpeed's gate: `wg` (E, d) without bias; `route(x)` -> (plan, l_aux, exp_counts)."""

    def __init__(self, model_dim: int, num_experts: int, k: int, capacity_factor: float,
                 eval_capacity_factor: float, min_capacity: int, noisy_gate_policy: str | None, drop_tokens: bool,
                 use_rts: bool, top2_2nd_expert_sampling: bool):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.num_experts, self.k, self.min_capacity = num_experts, k, min_capacity
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling

    def _capacity(self, tokens: int) -> int | None:
        if not self.drop_tokens:
            return None
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return expert_capacity(tokens, self.k, self.num_experts, factor, self.min_capacity)

    def _choices(self, logits: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """(S, k) chosen experts, first choice first."""
        if self.k == 1:
            noisy = self.noisy_gate_policy == "RSample" and self.training
            return (logits + _gumbel(logits) if noisy else gates).argmax(-1, keepdim=True)
        first = gates.argmax(-1)
        second_logits = logits + _gumbel(logits) if self.top2_2nd_expert_sampling else logits
        second = second_logits.masked_fill(F.one_hot(first, self.num_experts).bool(), float("-inf")).argmax(-1)
        return torch.stack([first, second], dim=-1)

    def route(self, x: torch.Tensor):
        x32 = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x32 = x32 * torch.empty_like(x32).uniform_(1 - 1e-2, 1 + 1e-2)
        logits = F.linear(x32, self.wg.weight.float())
        gates = logits.softmax(-1)  # (S, E)
        experts = self._choices(logits, gates)  # (S, k)
        tokens = x.shape[0]
        first_fraction = torch.bincount(experts[:, 0], minlength=self.num_experts).float() / tokens
        l_aux = self.num_experts * (gates.mean(0) * first_fraction).sum()
        chosen = gates.gather(1, experts)  # (S, k)
        if self.k == 1:
            order = torch.randperm(tokens, device=x.device) if self.use_rts else None
        else:
            order = torch.arange(tokens * 2, device=x.device).view(tokens, 2).t().reshape(-1)  # firsts, then seconds
        plan = plan_dispatch(experts, chosen, self.num_experts, self._capacity(tokens), order)
        if self.k == 2:  # renormalise over the choices that were kept
            kept = torch.zeros(tokens * 2, device=x.device).index_fill_(0, plan.choice, 1.0).view(tokens, 2)
            denom = (chosen * kept).sum(-1, keepdim=True).clamp(min=torch.finfo(chosen.dtype).eps)
            plan.weight = (chosen / denom).reshape(-1).index_select(0, plan.choice)
        return plan, l_aux, plan.counts.detach()


class MOELayer(nn.Module):
    """DeepSpeed's inner layer: the gate and the experts; keeps `l_aux` and `exp_counts` of the last forward.
    Under expert parallelism (`expert_layer()`) it holds `num_local_experts` of the gate's experts and sends
    each kept choice's row to the rank holding its expert (`expert_parallel_rows`)."""

    def __init__(self, gate: TopKGate, experts: StackedMLP, ep_size: int = 1):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_size, self.num_local_experts = ep_size, gate.num_experts // ep_size
        self.expert_group: ExpertGroup | None = None  # set by expert parallelism: the experts this rank holds
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def expert_layer(self) -> ExpertLayer:
        """For expert parallelism: every stacked weight (E, out, in) and bias (E, out) of the experts."""
        stacked = [(self.experts.weights, str(i)) for i in range(len(self.experts.weights))]
        stacked += [(self.experts.biases, str(i)) for i in range(len(self.experts.biases))]
        return ExpertLayer(self.gate.num_experts, stacked, self._keep_experts)

    def _keep_experts(self, group: ExpertGroup) -> None:
        self.num_local_experts, self.expert_group = group.local, group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        plan, self.l_aux, self.exp_counts = self.gate.route(flat)
        if self.expert_group is None:
            out = combine(self.experts(dispatch(flat, plan)), plan)
        else:
            out = combine_rows(expert_parallel_rows(flat, plan, self.experts, self.expert_group)[0], plan)
        return out.reshape(*hidden_states.shape[:-1], out.shape[-1])


def _refuse_unbuilt(ep_size: int, num_experts: int, k: int, enable_expert_tensor_parallelism: bool) -> None:
    if not isinstance(ep_size, int) or ep_size < 1 or num_experts % ep_size:
        works = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise InvalidValueError(f"deepspeed.moe.layer.MoE(num_experts={num_experts}, ep_size={ep_size}): ep_size "
                                f"must divide num_experts (each ep rank holds num_experts / ep_size of them); "
                                f"use ep_size in {works}")
    if k not in (1, 2):
        raise InvalidValueError(f"deepspeed.moe.layer.MoE(k={k}): paratrain implements DeepSpeed's top-1 and "
                                f"top-2 gating; use k=1 or k=2, or paratrain.moe.MoELayer(top_k={k})")
    if not 1 <= k <= num_experts:
        raise InvalidValueError(f"deepspeed.moe.layer.MoE(num_experts={num_experts}, k={k}): k must be at most "
                                f"num_experts")
    if enable_expert_tensor_parallelism:
        raise InvalidValueError("deepspeed.moe.layer.MoE(enable_expert_tensor_parallelism=True): expert tensor "
                                "parallelism is not built in paratrain; leave it False")


class MoE(nn.Module):
    """deepspeed.moe.layer.MoE. `use_tutel` is accepted and ignored (a kernel choice; the numbers are the same)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        _refuse_unbuilt(ep_size, num_experts, k, enable_expert_tensor_parallelism)
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise InvalidValueError(f"deepspeed.moe.layer.MoE(noisy_gate_policy={noisy_gate_policy!r}): use one of "
                                    f"{NOISY_GATE_POLICIES}")
        self.num_experts, self.ep_size, self.num_local_experts = num_experts, ep_size, num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_residual = use_residual
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, StackedMLP(expert, num_experts), ep_size)
        for param in self.deepspeed_moe.experts.parameters():  # DeepSpeed's marks (deepspeed.moe.utils reads them)
            param.allreduce, param.group_name = False, self.expert_group_name
        if use_residual:  # Residual MoE: the expert itself as a dense MLP, mixed by a learned 2-way softmax
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """A no-op: DeepSpeed makes its expert process groups here, one set per ep_size. paratrain's ep and
        expert-data-parallel groups are axes of the engine's mesh, made by `initialize` (which takes
        `expert_parallel.size` from the layers' ep_size), so there is nothing to make before it."""

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """-> (output (input's shape), l_aux (scalar), exp_counts (E,))."""
        if used_token is not None:
            raise InvalidValueError("deepspeed.moe.layer.MoE.forward(used_token=...): masking tokens out of the "
                                    "routing is not implemented in paratrain; pass used_token=None")
        output = self.deepspeed_moe(hidden_states)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = self.coefficient(hidden_states).softmax(-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def expert_parallel_size_of(model: nn.Module, configured: int) -> int:
    """The expert-parallel size for `model` given the config's `expert_parallel.size` (1: unset): the ep_size
    of its DeepSpeed MoE layers when it has some, which all must agree with each other and with a set config
    value (DeepSpeed allows one expert group per ep_size; paratrain has one ep axis)."""
    sizes = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            sizes.setdefault(module.ep_size, []).append(name or "<model>")
    if not sizes:
        return configured
    if len(sizes) > 1:
        found = "; ".join(f"ep_size={k} in {names[:3]}" for k, names in sorted(sizes.items()))
        raise InvalidValueError(f"the model's deepspeed.moe.layer.MoE layers have different ep_size ({found}): "
                                f"paratrain splits experts over one expert-parallel axis, so give every layer the "
                                f"same ep_size")
    (layers_size, names), = sizes.items()
    if configured not in (1, layers_size):
        raise InvalidValueError(f"config key 'expert_parallel.size' = {configured} but the model's "
                                f"deepspeed.moe.layer.MoE layers (e.g. '{names[0]}') have ep_size={layers_size}: "
                                f"the layers' ep_size sets the expert-parallel size; remove expert_parallel.size "
                                f"from the config, or build the layers with ep_size={configured}")
    return layers_size

"""Hugging Face mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) under paratrain.

transformers' experts modules hold every expert in two stacked tensors, `gate_up_proj` (E, 2I, d) and
`down_proj` (E, d, I), and route their forward through a registry keyed by `config._experts_implementation`
(`transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`), as attention goes through `AttentionInterface`. The
view registers `"paratrain"` there (`install_experts`), which computes the experts the way paratrain's own
`MoELayer` does:

    plan   = plan_dispatch(top_k_index, top_k_weights, E, capacity=None)   # dropless, sorted by expert
    buffer = dispatch(x, plan)                     # (E, C, d): C = the most rows one expert got
    out    = down(act(gate) · up) of the buffer    # one batched matmul per projection over all experts
    y      = combine(out, plan)                    # Σ weight · row per token

and, once expert parallelism kept experts [first, first + local) of a block on this rank (`ExpertLayer.assign`
stores the `ExpertGroup` on the experts module), sends each row to the rank of its expert and back
(`paratrain.moe.exchange.expert_parallel_rows`). The router, the shared expert and its gate are the block's
own modules, untouched: only the experts' compute is replaced, so parameter names stay Hugging Face's.

[Note: what is refused]
`output_router_logits=True` adds a load-balancing loss over the router logits of a whole forward, which the
layered forward (`hf/model.py`) never collects; its value over one rank's tokens differs from one process's, so it
is refused at initialize rather than silently dropped. `router_jitter_noise > 0` multiplies the block's input
by fresh random numbers in training, different per rank and layout: refused too.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import ConfigError
from paratrain.moe.dispatch import combine, combine_rows, dispatch, plan_dispatch
from paratrain.moe.exchange import ExpertGroup, ExpertLayer, expert_parallel_rows

EXPERTS_NAME = "paratrain"  # the key in transformers' experts registry
STACKED = ("gate_up_proj", "down_proj")
# Layout flags transformers' `use_experts_implementation` sets on an experts module, and the value this
# implementation computes (Mixtral's and Qwen-MoE's: [gate; up] concatenated, (out, in) weights, no biases).
LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
          "has_post_expert_norm": False}


def is_hf_experts(module: nn.Module) -> bool:
    """An experts module of transformers' `use_experts_implementation` kind: stacked 3-D expert tensors."""
    return hasattr(module, "is_concatenated") and all(
        isinstance(getattr(module, name, None), torch.Tensor) and getattr(module, name).dim() == 3 for name in STACKED)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if is_hf_experts(m)]


def unsupported_layout(experts: nn.Module) -> str | None:
    """Why paratrain's implementation cannot compute this experts module, or None."""
    wrong = [f"{flag}={getattr(experts, flag)}" for flag, value in LAYOUT.items() if getattr(experts, flag) != value]
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and apply_gate.__module__ != "transformers.integrations.moe":
        wrong.append("its own _apply_gate")
    return ", ".join(wrong) or None


def expert_mlp(experts: nn.Module, buffer: torch.Tensor) -> torch.Tensor:
    """(E_local, C, d) token rows per local expert -> (E_local, C, d): down(act(gate) · up), batched."""
    gate_up = torch.bmm(buffer, experts.gate_up_proj.transpose(1, 2))  # (E_local, C, 2I)
    return torch.bmm(experts._apply_gate(gate_up), experts.down_proj.transpose(1, 2))


def paratrain_experts(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-function contract: hidden_states (T, d), each token's k experts and weights (T, k)
    -> (T, d), the weighted sum of its experts' outputs."""
    group: ExpertGroup | None = getattr(experts, "expert_parallel", None)
    total = group.total if group is not None else experts.gate_up_proj.shape[0]
    plan = plan_dispatch(top_k_index, top_k_weights, total, capacity=None)
    if group is None:
        return combine(expert_mlp(experts, dispatch(hidden_states, plan)), plan)
    rows, _ = expert_parallel_rows(hidden_states, plan, lambda buffer: expert_mlp(experts, buffer), group)
    return combine_rows(rows, plan)


def install_experts(hf: nn.Module) -> bool:
    """Route `hf`'s experts modules through `paratrain_experts` when it has any and all fit its layout; True
    if it did. A model whose experts fit not keeps its own implementation (expert parallelism then refuses it)."""
    found = experts_modules(hf)
    if not found or any(unsupported_layout(m) for _, m in found):
        return False
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, paratrain_experts)
    hf.set_experts_implementation(EXPERTS_NAME)
    configs = {id(m.config): m.config for _, m in found}
    for config in configs.values():  # an experts module whose config set_experts_implementation did not reach
        config._experts_implementation_internal = EXPERTS_NAME
    return True


def _keep_experts(experts: nn.Module):
    def assign(group: ExpertGroup) -> None:
        experts.expert_parallel = group

    return assign


def hf_expert_layers(model: nn.Module) -> list[tuple[str, ExpertLayer]]:
    """For expert parallelism: every experts module's two stacked tensors, split along E."""
    out = []
    for name, experts in experts_modules(model):
        why = unsupported_layout(experts)
        if why is not None:
            raise ConfigError(f"expert_parallel with '{name}' ({type(experts).__name__}, {why}): paratrain's "
                              f"expert-parallel experts compute only the layout {LAYOUT}; set "
                              f"expert_parallel.size to 1")
        out.append((name, ExpertLayer(experts.gate_up_proj.shape[0], [(experts, n) for n in STACKED],
                                      _keep_experts(experts))))
    return out


def moe_blocks(layer: nn.Module) -> list[str]:
    """Names (under a decoder layer) of its MoE blocks: the modules whose child is an experts module (or the
    experts module itself, when the layer holds it directly)."""
    return [name.rpartition(".")[0] or name for name, m in layer.named_modules() if name and is_hf_experts(m)]


def check_moe_config(model: nn.Module, kind: str) -> None:
    """Refuse the router settings whose result depends on the layout (the module's note)."""
    if not experts_modules(model):
        return
    cfg = model.config
    if getattr(cfg, "output_router_logits", False):
        raise ConfigError(f"{kind} has output_router_logits = True: its load-balancing loss is a mean over the "
                          f"router logits of a whole forward, which paratrain's layered forward does not collect "
                          f"(over one rank's tokens it would differ from one process's); set "
                          f"model.config.output_router_logits = False")
    if (getattr(cfg, "router_jitter_noise", 0) or 0) > 0:
        raise ConfigError(f"{kind} has router_jitter_noise = {cfg.router_jitter_noise}: it scales each block's "
                          f"input by random numbers that differ per rank and layout; set "
                          f"model.config.router_jitter_noise = 0")


"""LoRA on stacked expert weights: every expert its own low-rank update (peft's `target_parameters`).

    settings = AdapterSettings(target_parameters=("mlp.experts.gate_proj", "mlp.experts.down_proj"), r=4)

An expert stack W (E, out, in) (paratrain's `GroupedSwiGLU`) gets A (E, r, in) and B (E, out, r): expert e computes
x W_eᵀ + s · (x A_eᵀ) B_eᵀ, one batched matmul per factor over all experts, never a weight-sized delta. The stacks
are the experts' module's `adapters[name]`, listed among its stacked tensors, so expert parallelism keeps each
rank's experts of A and B with their weights, and their gradients are reduced over the ranks holding the same
experts like the weights'. Names: `<experts>.adapters.<projection>.lora_A.<adapter>.weight` (and `lora_B`).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Stack(nn.Module):
    """One stacked (E, ...) adapter tensor, as `weight` (the name a ModuleDict entry of peft's layers has)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)


class ExpertLora(nn.Module):
    """LoRA adapters of one stacked projection (E, out, in); `forward` gives the addition, (E, C, in) -> (E, C, out)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, adapter: str = "default"):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.active = adapter

    def add_adapter(self, name: str, r: int, alpha: float, rslora: bool = False, device=None, dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        self.lora_A[name] = Stack(torch.zeros(self.num_experts, r, self.in_features, **factory))
        self.lora_B[name] = Stack(torch.zeros(self.num_experts, self.out_features, r, **factory))
        self.scaling[name] = alpha / math.sqrt(r) if rslora else alpha / r

    def stacked_parameters(self) -> list[tuple[nn.Module, str]]:
        return [(store[name], "weight") for store in (self.lora_A, self.lora_B) for name in store]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = self.active
        a, b = self.lora_A[name].weight, self.lora_B[name].weight  # (E, r, in), (E, out, r)
        return torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2)) * self.scaling[name]  # (E, C, out)

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """W + s·B·A per expert, (E, out, in)."""
        name = name or self.active
        return weight + self.scaling[name] * torch.bmm(self.lora_B[name].weight, self.lora_A[name].weight)


def expert_adapters(module: nn.Module) -> list[tuple[str, ExpertLora]]:
    """(name, adapter) of every expert-stack adapter in `module`, in module order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, ExpertLora)]

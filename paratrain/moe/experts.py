"""Experts as stacked parameters, computed with one batched matmul per projection over all experts.

Every expert weight is one tensor of shape (E, out, in) (nn.Linear's (out, in) per expert), so expert
parallelism will keep a slice of dim 0, and the compute is `torch.bmm` over the dispatch buffer (E, C, d):
one kernel per projection whatever E is, not a Python loop of E small matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import InvalidTypeError


def _linear_init(weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """nn.Linear's own default initialization, applied to each expert's (out, in) slice."""
    bound = 1 / math.sqrt(weight.shape[-1])
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


def _bmm_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(E, C, in) @ (E, out, in)^T -> (E, C, out): a batched nn.Linear without bias."""
    return torch.bmm(x, weight.transpose(1, 2))


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP (Llama's, same names): the shared expert that every token goes through."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedSwiGLU(nn.Module):
    """E SwiGLU experts (down(silu(gate x) · up x)): `gate_proj`, `up_proj` (E, d_ff, d), `down_proj` (E, d, d_ff).

    `adapters` maps a projection's name to a module that adds to it, (E, C, in) -> (E, C, out): LoRA on the
    stacked weights (`paratrain.adapters.experts`), whose own stacked tensors `stacked_parameters` lists with the
    weights, so expert parallelism keeps each rank's experts of both."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, d_model: int, d_ff: int):
        super().__init__()
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.gate_proj = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.up_proj = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.adapters = nn.ModuleDict()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            _linear_init(weight)

    def stacked_parameters(self) -> list[tuple[nn.Module, str]]:
        """(owner, attribute) of every (E, ...) tensor: the three weights and their adapters' stacks."""
        out = [(self, name) for name in self.PROJECTIONS]
        for adapter in self.adapters.values():
            out += adapter.stacked_parameters()
        return out

    def _project(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = _bmm_t(x, getattr(self, name))
        return out + self.adapters[name](x) if name in self.adapters else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (E, C, d) -> (E, C, d); the zero padding rows stay zero (no bias) and are never combined."""
        hidden = F.silu(self._project(x, "gate_proj")) * self._project(x, "up_proj")
        return self._project(hidden, "down_proj")


# Modules without parameters that act element by element: applied to the whole (E, C, d) buffer they do to
# each expert's rows what each copy would do to its own.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Identity, nn.Dropout)


class StackedMLP(nn.Module):
    """`num_experts` copies of a user's expert (an nn.Linear, or an nn.Sequential of nn.Linear and element-wise
    activations), with each Linear's copies stacked: weight i (E, out, in), bias i (E, out). The copies start
    equal, as DeepSpeed's deep copies do."""

    def __init__(self, expert: nn.Module, num_experts: int):
        super().__init__()
        layers = list(expert) if isinstance(expert, nn.Sequential) else [expert]
        self.weights, self.biases, self.steps = nn.ParameterList(), nn.ParameterList(), []
        for index, layer in enumerate(layers):
            if isinstance(layer, nn.Linear) and type(layer) is nn.Linear:
                self.steps.append(("linear", len(self.weights), layer.bias is not None))
                self.weights.append(nn.Parameter(layer.weight.detach().clone().expand(num_experts, -1, -1)
                                                 .contiguous()))
                if layer.bias is not None:
                    self.biases.append(nn.Parameter(layer.bias.detach().clone().expand(num_experts, -1)
                                                    .contiguous()))
            elif isinstance(layer, ELEMENTWISE) and not any(True for _ in layer.parameters()):
                self.add_module(f"act{index}", layer)
                self.steps.append(("act", f"act{index}", False))
            else:
                raise InvalidTypeError(
                    f"deepspeed.moe.layer.MoE(expert=...): paratrain batches the experts, so the expert must be an "
                    f"nn.Linear or an nn.Sequential of nn.Linear and element-wise activations "
                    f"({', '.join(c.__name__ for c in ELEMENTWISE)}); layer {index} is {type(layer).__name__}. "
                    f"Rewrite the expert as such an nn.Sequential, or use paratrain.moe.MoELayer (SwiGLU experts)")
        if not self.weights:
            raise InvalidTypeError("deepspeed.moe.layer.MoE(expert=...): the expert has no nn.Linear; "
                                   "pass an nn.Linear or an nn.Sequential holding one")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (E, C, in) -> (E, C, out). Padding rows get the bias, but combine never reads them."""
        bias_index = 0
        for kind, ref, has_bias in self.steps:
            if kind == "act":
                x = getattr(self, ref)(x)
                continue
            x = _bmm_t(x, self.weights[ref])
            if has_bias:
                x = x + self.biases[bias_index].unsqueeze(1)
                bias_index += 1
        return x

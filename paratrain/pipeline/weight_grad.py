"""Splitting a stage's backward into B (input gradient) and W (weight gradient) for ZB-H1.

[Note: deferring dW per Linear]
A Linear's backward does two matmuls: dx = dy·Wᵀ, which the previous stage is waiting for, and
dW = dyᵀ·x, which nobody needs until the optimizer step. `WeightGradDeferral.install` makes every
Linear of the stage compute only dx (and the cheap bias gradient) during B and stash (x, dy); W later
computes dW = dyᵀ·x from the stash. Each matmul runs exactly once, so the split costs no extra compute,
only the memory of (x, dy) between B and W. Other parameters (norms, embeddings) are cheap and keep
their gradient in B.

The Linear passes a *detached* weight into its autograd function, so autograd has no edge to the weight
and B does not touch it at all (a function that returned None for an input would still run the weight's
gradient accumulator and fire its hooks). W then delivers dW with `torch.autograd.backward` on the weight
itself, which accumulates into `.grad` through the weight's accumulator: post-accumulate-grad hooks fire
as for any gradient, so DDP's bucket hooks see weight gradients exactly when they land.
"""

from __future__ import annotations

import types
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import RunError


class _LinearInputGradOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_detached, bias, owner):
        ctx.save_for_backward(x, weight_detached)
        ctx.owner = owner  # (deferral, module)
        ctx.has_bias = bias is not None
        return F.linear(x, weight_detached, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        deferral, module = ctx.owner
        deferral.stash(module, x, dy)
        dx = dy @ weight if ctx.needs_input_grad[0] else None  # (..., in)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, db, None


def _deferred_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    deferral = module._weight_grad_deferral
    if deferral.active and torch.is_grad_enabled():
        return _LinearInputGradOnly.apply(x, module.weight.detach(), module.bias, (deferral, module))
    return F.linear(x, module.weight, module.bias)


class WeightGradDeferral:
    """Collects (x, dy) per Linear during B under the current key; `pop(key)` returns the weights and
    their gradients dW for W."""

    def __init__(self) -> None:
        self.active = False
        self.key = None
        self._stash: dict = defaultdict(list)
        self.count = 0

    def install(self, module: nn.Module) -> int:
        """Route every trainable nn.Linear in `module` through the split backward; returns how many."""
        for sub in module.modules():
            if isinstance(sub, nn.Linear) and sub.weight.requires_grad:
                sub._weight_grad_deferral = self
                sub.forward = types.MethodType(_deferred_forward, sub)
                self.count += 1
        self.active = True
        return self.count

    def stash(self, module: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> None:
        if self.key is None:
            raise RunError("a deferred Linear ran its backward outside a pipeline B action")
        self._stash[self.key].append((module.weight, x, dy))

    def pending(self) -> int:
        return len(self._stash)

    def pop(self, key) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        grads: dict[nn.Parameter, torch.Tensor] = {}
        for weight, x, dy in self._stash.pop(key, []):
            dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])  # (out, in)
            grads[weight] = grads[weight] + dw if weight in grads else dw
        return list(grads), list(grads.values())

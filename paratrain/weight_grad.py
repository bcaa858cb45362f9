"""The linear kernel every projection runs, and the split of its backward into B (input gradient) and W (weight
gradient) that the zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) need.

    y = linear(x, weight, bias)                          # F.linear, unless a deferral holds the weight
    y = linear(x, [w_q, w_k, w_v], bias, dim=0)          # a packed projection: the parts side by side
    deferral = WeightGradDeferral(); deferral.register(weights)   # (the pipeline runtime does this)

[Note: deferring dW per projection]
A projection's backward does two matmuls: dx = dy·Wᵀ, which the previous stage is waiting for, and
dW = dyᵀ·x, which nobody needs until the optimizer step. Under a split backward every projection whose weight
is registered with a `WeightGradDeferral` computes only dx (and the cheap bias gradient) during B and stashes
(x, dy); W later computes dW = dyᵀ·x from the stash. Each matmul runs exactly once, so the split costs no extra
compute, only the memory of (x, dy) between B and W. Other parameters (norms, embeddings) are cheap and keep
their gradient in B.

Being a property of the kernel, the split reaches every layer that projects through `linear`: torch's
`nn.Linear` (routed here by `WeightGradDeferral.install`) and tensor parallelism's column- and row-parallel
layers alike, so ZB-H1, ZB-V and DualPipeV keep their bubble filling with tp > 1.

The kernel passes a *detached* weight into its autograd function, so autograd has no edge to the weight and B
does not touch it at all (a function that returned None for an input would still run the weight's gradient
accumulator and fire its hooks). W then delivers dW with `torch.autograd.backward` on the weight itself, which
accumulates into `.grad` through the weight's accumulator: post-accumulate-grad hooks fire as for any gradient,
so DDP's bucket hooks see weight gradients exactly when they land.
"""

from __future__ import annotations

import types
import weakref
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import RunError

# id(weight) -> its WeightGradDeferral; an entry leaves with its weight (tensors compare elementwise, so they
# cannot be the keys of a WeakKeyDictionary)
_DEFERRAL_OF: dict[int, WeightGradDeferral] = {}


def linear(x: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor], bias: torch.Tensor | None = None, *,
           transposed: bool = False, dim: int = 0) -> torch.Tensor:
    """F.linear(x, W, bias) with W = `weight`, or the parts of `weight` concatenated along `dim`; a transposed
    weight (a Conv1D's, stored (in, out)) is used as W.t(). Under a split backward whose deferral holds the
    weight, its gradient waits for W (the note)."""
    parts = list(weight) if isinstance(weight, (list, tuple)) else [weight]
    deferral = _DEFERRAL_OF.get(id(parts[0]))
    # An input without a gradient (a frozen embedding's output, the first LoRA layer's input) leaves no dx to
    # hurry and no autograd node to stash (x, dy) from: the weight gradient is then computed in B as usual.
    if deferral is not None and deferral.active and torch.is_grad_enabled() and parts[0].requires_grad \
            and x.requires_grad:
        detached = parts[0].detach() if len(parts) == 1 else torch.cat([p.detach() for p in parts], dim)
        return _InputGradOnly.apply(x, detached, bias, (deferral, parts, dim, transposed))
    whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    return F.linear(x, whole.t() if transposed else whole, bias)


class _InputGradOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_detached, bias, owner):
        ctx.save_for_backward(x, weight_detached)
        ctx.owner = owner  # (deferral, weight parts, dim, transposed)
        ctx.has_bias = bias is not None
        transposed = owner[3]
        return F.linear(x, weight_detached.t() if transposed else weight_detached, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        deferral, parts, dim, transposed = ctx.owner
        deferral.stash(parts, dim, transposed, x, dy)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ (weight.t() if transposed else weight)  # (..., in)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, db, None


def _deferred_linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


class WeightGradDeferral:
    """Collects (x, dy) per projection during B under the current key; `pop(key)` returns the weights and
    their gradients dW for W."""

    def __init__(self) -> None:
        self.active = False
        self.key = None
        self._stash: dict = defaultdict(list)
        self.count = 0  # projections whose weight gradient is deferred
        self.computed = 0  # dW matmuls W has run (one per projection and micro-batch and stage)

    def install(self, module: nn.Module) -> int:
        """Defer the weight gradient of every trainable projection in `module`: torch's nn.Linear (its forward
        routed through `linear`), and every layer that names its projection weights (`weight_grad_parameters()`,
        as the tensor-parallel layers do); returns how many."""
        for sub in module.modules():
            if isinstance(sub, nn.Linear) and sub.weight.requires_grad:
                sub.forward = types.MethodType(_deferred_linear_forward, sub)
                self.register([sub.weight])
            elif hasattr(sub, "weight_grad_parameters"):
                weights = [w for w in sub.weight_grad_parameters() if w.requires_grad]
                if weights:
                    self.register(weights)
        self.active = True
        return self.count

    def register(self, weights: Sequence[nn.Parameter]) -> None:
        """One projection's weight (or the parts of a packed one, registered together)."""
        if id(weights[0]) not in _DEFERRAL_OF:
            weakref.finalize(weights[0], _DEFERRAL_OF.pop, id(weights[0]), None)
        _DEFERRAL_OF[id(weights[0])] = self
        self.count += 1

    def stash(self, parts: list, dim: int, transposed: bool, x: torch.Tensor, dy: torch.Tensor) -> None:
        if self.key is None:
            raise RunError("a deferred projection ran its backward outside a pipeline B action")
        self._stash[self.key].append((parts, dim, transposed, x, dy))

    def pending(self) -> int:
        return len(self._stash)

    def pop(self, key) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        grads: dict[nn.Parameter, torch.Tensor] = {}
        for parts, dim, transposed, x, dy in self._stash.pop(key, []):
            dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])  # (out, in)
            dw = dw.t() if transposed else dw
            self.computed += 1
            pieces = dw.split([p.shape[dim] for p in parts], dim) if len(parts) > 1 else (dw,)
            for weight, piece in zip(parts, pieces):
                grads[weight] = grads[weight] + piece if weight in grads else piece
        return list(grads), list(grads.values())

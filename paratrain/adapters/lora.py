"""The low-rank adapter layer: a frozen linear layer plus LoRA's update (or DoRA's), under peft's names.

    layer = LoraLinear(base, r=8, alpha=16)          # base: an nn.Linear (or GPT-2's Conv1D), kept as `base_layer`
    y = layer(x)                                      # base(x) + B(A(dropout(x))) · scaling

The children are peft's, name for name (`base_layer`, `lora_A.<adapter>`, `lora_B.<adapter>`,
`lora_dropout.<adapter>`, `lora_magnitude_vector.<adapter>.weight`), so a parameter has the same name whether the
layer came from `peft.get_peft_model` (converted in place by `from_peft.py`) or from paratrain's `peft` config
section, and the adapter leaves in peft's format by a fixed renaming (`peft_format.py`).

[Note: one forward for every layout]
The forward only calls its children: `base_layer(x)`, `lora_B(lora_A(x))`. Tensor parallelism replaces the
children with split ones (`paratrain.parallel.tp.lora`): a column-parallel base gets a column-parallel `lora_B`
(A whole), a row-parallel base a row-parallel `lora_A` (B whole), and the same forward then computes this rank's
part. DoRA needs one thing more, the norm of each output row of W + scaling·B·A: under a row-parallel base each
rank holds a slice of every row, so the layer sums the squares over `norm_axis` (set by the split) before the
root. ZeRO-3 gathers `base_layer`'s weight with the rest of the unit, so the forward reads it as any layer does.

[Note: DoRA, as peft computes it]
DoRA rescales each output row of the adapted weight to a learned magnitude m: W' = m · (W + sBA) / ‖W + sBA‖_row.
peft (and the paper, section 4.3) treats the norm as a constant (no gradient), and adds to the base output
(m/‖·‖ − 1) · (x Wᵀ) + (m/‖·‖) · s · B(A(x)), reusing the base output when there is no dropout. With dropout in
training, peft recomputes the base product on the dropped input; here that is `base_layer(dropped) − bias`, which
stays correct when the base is split.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from paratrain.comm import all_reduce
from paratrain.errors import InvalidValueError

DORA_NORM_TAG = "tp_dora_norm"  # the sum over tp of a row-parallel DoRA layer's squared row norms


class Magnitude(nn.Module):
    """DoRA's learned magnitude of each output row (peft's `DoraLinearLayer`: one parameter, `weight` (out,))."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)


def base_weight(layer: nn.Module) -> torch.Tensor:
    """The base layer's weight as (out, in): a Conv1D stores it transposed (fan_in_fan_out)."""
    weight = layer.weight
    return weight.t() if type(layer).__name__ == "Conv1D" or getattr(layer, "transposed", False) else weight


class LoraLinear(nn.Module):
    """A linear layer with one or more named low-rank adapters; one is active while training (`active`)."""

    def __init__(self, base_layer: nn.Module, adapter: str = "default"):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.lora_magnitude_vector = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.ranks: dict[str, int] = {}
        self.alphas: dict[str, float] = {}
        self.active = adapter
        self.norm_axis = None  # set by tensor parallelism when each rank holds a slice of every row (rowwise)

    @property
    def in_features(self) -> int:
        return getattr(self.base_layer, "in_features", None) or base_weight(self.base_layer).shape[1]

    @property
    def out_features(self) -> int:
        return getattr(self.base_layer, "out_features", None) or base_weight(self.base_layer).shape[0]

    def add_adapter(self, name: str, r: int, alpha: float, *, dropout: float = 0.0, rslora: bool = False,
                    bias: bool = False, dora: bool = False, device=None, dtype=None) -> None:
        """Add adapter `name` with zero weights (A, B, and m = 1 for DoRA): the caller initializes them."""
        if r <= 0:
            raise InvalidValueError(f"a LoRA adapter needs a rank r > 0, got {r}")
        factory = {"device": device, "dtype": dtype}
        self.lora_A[name] = nn.Linear(self.in_features, r, bias=False, **factory)
        self.lora_B[name] = nn.Linear(r, self.out_features, bias=bias, **factory)
        self.lora_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if dora:
            self.lora_magnitude_vector[name] = Magnitude(torch.ones(self.out_features, **factory))
        self.ranks[name], self.alphas[name] = r, alpha
        self.scaling[name] = alpha / math.sqrt(r) if rslora else alpha / r

    def is_dora(self, name: str | None = None) -> bool:
        return (name or self.active) in self.lora_magnitude_vector

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        name = self.active
        if name not in self.lora_A:
            return result
        lora_a, lora_b, dropout = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        dtype = result.dtype
        x = x.to(lora_a.weight.dtype)
        if not self.is_dora(name):
            return (result + lora_b(lora_a(dropout(x))) * self.scaling[name]).to(dtype)
        if isinstance(dropout, nn.Identity) or not self.training:
            return (result + self._dora_delta(x, result)).to(dtype)
        dropped = dropout(x)
        return (result + self._dora_delta(dropped, self.base_layer(dropped))).to(dtype)

    def _dora_delta(self, x: torch.Tensor, base_result: torch.Tensor) -> torch.Tensor:
        """DoRA's addition to the base output (the module note), for the input `x` whose base output (bias
        included) is `base_result`."""
        name = self.active
        scaling = self.scaling[name]
        magnitude = self.lora_magnitude_vector[name].weight
        scale = (magnitude / self.weight_norm(name, x.dtype)).view(1, -1)
        lora_result = self.lora_B[name](self.lora_A[name](x))
        bias = getattr(self.base_layer, "bias", None)
        if bias is not None:
            base_result = base_result - bias
        return (scale - 1) * base_result + scale * lora_result * scaling

    def lora_weight(self, name: str) -> torch.Tensor:
        """B·A, (out, in), or this rank's block of it under tensor parallelism."""
        return self.lora_B[name].weight @ self.lora_A[name].weight

    @torch.no_grad()
    def weight_norm(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """‖W + scaling·B·A‖ of every output row (out,), a constant to autograd; summed over `norm_axis` when this
        rank holds a slice of each row."""
        weight = base_weight(self.base_layer)
        weight = weight.to(dtype) if dtype is not None else weight
        adapted = weight + self.scaling[name] * self.lora_weight(name).to(weight.dtype)
        if self.norm_axis is None:
            return torch.linalg.norm(adapted, dim=1).to(weight.dtype)
        squares = adapted.pow(2).sum(dim=1)
        all_reduce(squares, self.norm_axis, tag=DORA_NORM_TAG)
        return squares.sqrt().to(weight.dtype)

    @torch.no_grad()
    def merged_weight(self, name: str | None = None) -> torch.Tensor:
        """The base weight with the adapter folded in (`merge_adapter`), in the base's own layout."""
        name = name or self.active
        weight = self.base_layer.weight.detach().clone()
        magnitude = self.lora_magnitude_vector[name].weight if self.is_dora(name) else None
        return merge_adapter(weight, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name],
                             magnitude, transposed=base_weight(self.base_layer) is not self.base_layer.weight)

    def reset_adapter(self, name: str, generator: torch.Generator | None = None, init: str = "default") -> None:
        """peft's initialization: A as nn.Linear's default (kaiming-uniform, a=√5; "gaussian": N(0, 1/r)), B zeros,
        DoRA's magnitude the row norms of W (the adapter starts as the identity)."""
        with torch.no_grad():
            draw_lora_a(self.lora_A[name].weight, generator, init)
            nn.init.zeros_(self.lora_B[name].weight)
            if self.lora_B[name].bias is not None:
                nn.init.zeros_(self.lora_B[name].bias)
            if self.is_dora(name):  # B = 0: ‖W + s·B·A‖ = ‖W‖, summed in float64 as the deferred fill does
                weight = base_weight(self.base_layer).detach()
                self.lora_magnitude_vector[name].weight.copy_(weight.double().pow(2).sum(1).sqrt())

    def extra_repr(self) -> str:
        adapters = ", ".join(f"{n}: r={self.ranks.get(n)}{' dora' if self.is_dora(n) else ''}" for n in self.lora_A)
        return f"adapters [{adapters}], active={self.active!r}"


@torch.no_grad()
def merge_adapter(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                  magnitude: torch.Tensor | None = None, transposed: bool = False) -> torch.Tensor:
    """Fold an adapter into the base weight, in place (peft's merge): W + s·B·A for LoRA, and for DoRA each output
    row then rescaled to its magnitude, (m / ‖W + s·B·A‖_row) · (W + s·B·A). `weight` is (out, in), or (in, out)
    for a Conv1D (`transposed`); no temporary of its size is made, so a streamed merge holds one weight at a time."""
    if transposed:
        weight.addmm_(lora_a.t().to(weight.dtype), lora_b.t().to(weight.dtype), alpha=scaling)  # (in, out)
    else:
        weight.addmm_(lora_b.to(weight.dtype), lora_a.to(weight.dtype), alpha=scaling)  # (out, in)
    if magnitude is not None:
        out_dim = 1 if transposed else 0
        factor = magnitude.to(weight.dtype) / torch.linalg.norm(weight, dim=1 - out_dim)
        weight.mul_(factor.unsqueeze(1 - out_dim))
    return weight


def draw_lora_a(weight: torch.Tensor, generator: torch.Generator | None, init: str = "default") -> torch.Tensor:
    """A's initial values, in place: nn.Linear's default (kaiming-uniform with a = √5 on (r, in): U(±1/√in)), or
    "gaussian" N(0, 1/r), peft's two; drawn from `generator` in the same order whatever holds the tensor."""
    if init == "gaussian":  # (an expert stack's A is (E, r, in): the last two dimensions)
        return weight.normal_(0.0, 1.0 / weight.shape[-2], generator=generator)
    bound = 1.0 / math.sqrt(weight.shape[-1])
    return weight.uniform_(-bound, bound, generator=generator)


def lora_layers(module: nn.Module) -> list[tuple[str, LoraLinear]]:
    """(name, layer) of every adapter layer in `module`, in module order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, LoraLinear)]



@contextmanager
def adapters_disabled(layers: list[LoraLinear]):
    """Every layer computes its base alone inside (the base model: DPO's reference without a second copy)."""
    saved = [layer.active for layer in layers]
    for layer in layers:
        layer.active = None
    try:
        yield
    finally:
        for layer, active in zip(layers, saved):
            layer.active = active

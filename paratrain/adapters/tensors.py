"""The adapters' tensors by name: what each starts as.

A model whose adapters hold no values yet (built on the meta device, or a pretrained base loaded from a file
that holds no adapter) gets them from their names alone (`initial_value`): A drawn from the generator of its own
name, B zero, DoRA's magnitude the row norms of the base weight under it (a collective over whatever layout
holds that weight: `paratrain.init.adapters`). The same values eager injection gives, in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.adapters.experts import expert_adapters
from paratrain.adapters.lora import LoraLinear, base_weight, draw_lora_a, lora_layers
from paratrain.adapters.settings import adapter_generator


@dataclass(frozen=True)
class AdapterTensor:
    name: str  # in the model's own (original) names
    kind: str  # "lora_A", "zeros" (B and its bias) or "magnitude"
    shape: tuple[int, ...]
    base: str = ""  # magnitude: the name of the base weight whose row norms it starts as
    out_dim: int = 0  # magnitude: the base weight's output dimension (1 for a Conv1D, stored (in, out))


def adapter_tensors(model: nn.Module) -> list[AdapterTensor]:
    """Every adapter tensor of `model` (before any strategy split it: full shapes)."""
    out = []
    for path, layer in lora_layers(model):
        base = layer.base_layer
        out_dim = 0 if base_weight(base) is base.weight else 1
        for adapter, module in layer.lora_A.items():
            out.append(AdapterTensor(f"{path}.lora_A.{adapter}.weight", "lora_A", tuple(module.weight.shape)))
        for adapter, module in layer.lora_B.items():
            out += [AdapterTensor(f"{path}.lora_B.{adapter}.{n}", "zeros", tuple(p.shape))
                    for n, p in module.named_parameters(recurse=False)]
        for adapter, module in layer.lora_magnitude_vector.items():
            out.append(AdapterTensor(f"{path}.lora_magnitude_vector.{adapter}.weight", "magnitude",
                                     tuple(module.weight.shape), f"{path}.base_layer.weight", out_dim))
    for path, adapter in expert_adapters(model):
        for name, store in (("lora_A", adapter.lora_A), ("lora_B", adapter.lora_B)):
            out += [AdapterTensor(f"{path}.{name}.{a}.weight", name if name == "lora_A" else "zeros",
                                  tuple(m.weight.shape)) for a, m in store.items()]
    return out


def initial_value(tensor: AdapterTensor, seed: int, init: str = "default") -> torch.Tensor:
    """The starting value of an A or a B (the magnitude depends on the base: `paratrain.init.adapters`)."""
    value = torch.zeros(tensor.shape)
    if tensor.kind == "lora_A":
        draw_lora_a(value, adapter_generator(seed, tensor.name), init)
    return value


def adapter_submodules(model: nn.Module) -> set[int]:
    """ids of the modules inside adapters (A, B, magnitude, dropout): not part of the model's construction, so
    deferred initialization leaves them to `initial_value` instead of replaying their constructors' draws."""
    out = set()
    for _, layer in lora_layers(model):
        for store in (layer.lora_A, layer.lora_B, layer.lora_magnitude_vector, layer.lora_dropout):
            out.update(id(m) for m in store.modules())
    for _, adapter in expert_adapters(model):
        out.update(id(m) for m in adapter.modules())
    return out


def is_adapter_layer(module: nn.Module) -> bool:
    return isinstance(module, LoraLinear)

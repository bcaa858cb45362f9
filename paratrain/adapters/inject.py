"""Adapters put into a model by paratrain itself (the `peft` config section), for any model family.

    layers = inject_adapters(model, AdapterSettings(target_modules=["q_proj", "v_proj"], r=8, alpha=16), seed=0)

Every module `target_modules` names must be a linear layer (nn.Linear, or GPT-2's Conv1D): it is replaced, in
place and under the same name, by a `LoraLinear` holding it as `base_layer`. Then, as peft does, every parameter
is frozen except the adapters and the modules of `modules_to_save`. Errors name the field and the fix, before
anything changes.
"""

from __future__ import annotations

import difflib
import re

import torch
from torch import nn

from paratrain.adapters.experts import ExpertLora
from paratrain.adapters.lora import LoraLinear, draw_lora_a, lora_layers
from paratrain.adapters.settings import AdapterSettings, adapter_generator
from paratrain.adapters.torchao_nf4 import NF4Linear, is_nf4_weight
from paratrain.errors import InvalidValueError
from paratrain.layout.patterns import match

WILDCARDS = set("*?[")


class AdapterError(InvalidValueError):
    """An adapter config that cannot apply to the model: the message names the field and the fix."""


def is_linear(module: nn.Module) -> bool:
    """nn.Linear (or torchao's NF4 base in one, `NF4Linear`), or GPT-2's Conv1D."""
    return type(module) in (nn.Linear, NF4Linear) or (
        type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None and module.weight.dim() == 2)


def name_matches(entry: str, name: str) -> bool:
    """peft's rule for one `target_modules` entry (the name, or a suffix after a dot), or a dotted pattern."""
    if WILDCARDS & set(entry):
        return match(entry, name) or match(f"**.{entry}", name)
    return name == entry or name.endswith("." + entry)


def matched_modules(model: nn.Module, targets, field_name: str = "peft.target_modules") -> list[str]:
    """The names of the modules `targets` selects; an entry that selects nothing is refused by name."""
    names = [n for n, _ in model.named_modules() if n]
    if isinstance(targets, str):
        hits = [n for n in names if re.fullmatch(targets, n)]
        if not hits:
            raise AdapterError(f"{field_name} = {targets!r} (a regular expression the whole module name must match) "
                               f"matches no module; module names look like {names[:4]}")
        return hits
    if not targets:
        raise AdapterError(f"{field_name} is empty: name the linear layers to adapt, e.g. [\"q_proj\", \"v_proj\"]")
    hits = []
    for entry in targets:
        found = [n for n in names if name_matches(entry, n)]
        if not found:
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and is_linear(m)})
            close = difflib.get_close_matches(entry, leaves, n=3)
            hint = f"did you mean {close}? " if close else ""
            raise AdapterError(f"{field_name} entry {entry!r} matches no module of {type(model).__name__}; {hint}"
                               f"its linear layers are named {leaves[:12]}")
        hits += [n for n in found if n not in hits]
    return [n for n in names if n in hits]


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def check_settings(settings: AdapterSettings) -> None:
    if settings.method not in ("lora", "dora"):
        raise AdapterError(f"peft.method = {settings.method!r}: use \"lora\" or \"dora\"")
    if settings.r <= 0:
        raise AdapterError(f"peft.r = {settings.r}: the rank must be a positive integer")
    if not 0.0 <= settings.dropout < 1.0:
        raise AdapterError(f"peft.dropout = {settings.dropout}: a probability in [0, 1)")
    if settings.dora and settings.bias:
        raise AdapterError("peft.bias with peft.method \"dora\": DoRA's magnitude already rescales each output, and "
                           "peft refuses the pair too; set bias to false or use method \"lora\"")


def inject_adapters(model: nn.Module, settings: AdapterSettings, seed: int) -> list[tuple[str, LoraLinear]]:
    """Wrap every target linear layer of `model` in a `LoraLinear` with the adapter of `settings` (initialized from
    `seed` and each tensor's name, the same in every layout), freeze the rest as peft does; in place."""
    check_settings(settings)
    only_stacks = settings.target_parameters and not settings.target_modules
    targets = [] if only_stacks else matched_modules(model, settings.target_modules)
    modules = dict(model.named_modules())
    for name in targets:
        module = modules[name]
        if isinstance(module, LoraLinear) or any(name.startswith(f"{t}.") for t in targets if t != name):
            continue
        if not is_linear(module):
            raise AdapterError(f"peft.target_modules selects '{name}', a {type(module).__name__}, which is not a "
                               f"linear layer: paratrain's adapters wrap nn.Linear (and GPT-2's Conv1D) layers; "
                               f"expert stacks go in peft.target_parameters. Narrow the entry to the linear layers")
        if settings.dora and is_nf4_weight(module.weight):
            raise AdapterError(f"peft.method 'dora' on '{name}', whose base is torchao's NF4: DoRA's magnitude needs "
                               f"the base's row norms, which are not built over a 4-bit base; use peft.method 'lora'")
    to_save = matched_modules(model, settings.modules_to_save, "peft.modules_to_save") \
        if settings.modules_to_save else []
    stacks = _matched_stacks(model, settings)
    for p in model.parameters():
        p.requires_grad_(False)
    name = settings.adapter_name
    for target in targets:
        base = modules[target]
        if not is_linear(base):
            continue  # a parent of a linear target (refused above unless it is one)
        layer = LoraLinear(base, name)
        weight = base.weight
        layer.add_adapter(name, settings.r, settings.alpha, dropout=settings.dropout, rslora=settings.rslora,
                          bias=settings.bias, dora=settings.dora, device=weight.device, dtype=weight.dtype)
        if not weight.is_meta:  # a meta model's adapters are drawn when it is filled (same generator)
            init_adapter(layer, target, settings, seed)
        _set_submodule(model, target, layer)
    for target in to_save:
        for p in model.get_submodule(target).parameters():
            p.requires_grad_(True)
    for path, owner, attr, param in stacks:
        _adapt_stack(path, owner, attr, param, settings, seed)
    return lora_layers(model)


def _matched_stacks(model: nn.Module, settings: AdapterSettings) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(path, owner, attribute, parameter) of every expert stack `target_parameters` selects (peft's rule: a
    parameter's full name, or a suffix of it after a dot); anything else is refused by name."""
    params = dict(model.named_parameters())
    out = []
    for entry in settings.target_parameters:
        found = [n for n in params if n == entry or n.endswith("." + entry)]
        if not found:
            stacks = sorted({n.split(".")[-2] + "." + n.split(".")[-1] for n, p in params.items() if p.dim() == 3})
            raise AdapterError(f"peft.target_parameters entry {entry!r} matches no parameter of "
                               f"{type(model).__name__}; its stacked (3-d) parameters end in {stacks[:8] or 'nothing'}")
        for name in found:
            path, _, attr = name.rpartition(".")
            owner = model.get_submodule(path)
            if params[name].dim() != 3 or attr not in getattr(owner, "PROJECTIONS", ()) or \
                    not isinstance(getattr(owner, "adapters", None), nn.ModuleDict):
                raise AdapterError(f"peft.target_parameters selects '{name}' ({type(owner).__name__}, shape "
                                   f"{list(params[name].shape)}), which is not an expert stack paratrain adapts: "
                                   f"the (E, out, in) projections of paratrain's MoE experts (GroupedSwiGLU); "
                                   f"linear layers go in peft.target_modules")
            out.append((path, owner, attr, params[name]))
    if out and settings.dora:
        raise AdapterError("peft.method \"dora\" with peft.target_parameters: DoRA's magnitude on expert stacks is "
                           "not built (peft refuses it too); use method \"lora\" for the experts")
    return out


def _adapt_stack(path: str, owner: nn.Module, attr: str, param: nn.Parameter, settings: AdapterSettings,
                 seed: int) -> None:
    """LoRA on one expert stack (`paratrain.adapters.experts`), A drawn from its own name, B zero."""
    experts, out_features, in_features = param.shape
    adapter = ExpertLora(experts, in_features, out_features, settings.adapter_name)
    adapter.add_adapter(settings.adapter_name, settings.r, settings.alpha, settings.rslora, device=param.device,
                        dtype=param.dtype)
    owner.adapters[attr] = adapter
    if not param.is_meta:
        name = f"{path}.adapters.{attr}.lora_A.{settings.adapter_name}.weight"
        with torch.no_grad():
            draw_lora_a(adapter.lora_A[settings.adapter_name].weight, adapter_generator(seed, name), settings.init)


def init_adapter(layer: LoraLinear, name: str, settings: AdapterSettings, seed: int) -> None:
    """The adapter's initial values: A from the generator of its own name (`adapter_generator`), B zeros, DoRA's
    magnitude the row norms of the base weight."""
    adapter = settings.adapter_name
    layer.reset_adapter(adapter, adapter_generator(seed, f"{name}.lora_A.{adapter}.weight"), settings.init)

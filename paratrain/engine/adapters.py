"""The model's adapters, before anything is split: put in from the `peft` section, or taken from a peft model."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from paratrain.adapters import AdapterError, AdapterSettings, inject_adapters, lora_layers
from paratrain.adapters.peft_format import settings_from_config
from paratrain.adapters.quantized import quantize_bases
from paratrain.adapters.torchao_nf4 import adopt_nf4_layers, quantize_nf4_bases
from paratrain.checkpoint.adapters import read_adapter_config
from paratrain.config import Config
from paratrain.model_spec import ModelSpec, spec_for


def settings_of(config: Config) -> AdapterSettings | None:
    """The `peft` section as the adapters' own settings (None when the config has none)."""
    section = config.peft
    if section is None:
        return None
    targets = section.target_modules if isinstance(section.target_modules, str) else tuple(section.target_modules)
    given = dict(target_modules=targets, method=section.method, r=section.r, alpha=section.alpha,
                 dropout=section.dropout, rslora=section.rslora, bias=section.bias, init=section.init,
                 modules_to_save=tuple(section.modules_to_save), adapter_name=section.adapter_name,
                 target_parameters=tuple(section.target_parameters))
    if section.load is None:
        return AdapterSettings(**given)
    # peft.load: the directory's adapters, but for the keys the section sets (which must then agree with it)
    saved = settings_from_config(read_adapter_config(section.load), section.adapter_name)
    return replace(saved, **{k: v for k, v in given.items() if k in section.model_fields_set})


def prepare_adapters(model: nn.Module, config: Config, spec: ModelSpec) -> AdapterSettings | None:
    """The adapters of `model` (already adapted by its spec): the peft model's own, or those the `peft` section
    puts in now (in place, each drawn from the seed and its name); None when it has none."""
    held = spec.adapter_settings(model)
    wanted = settings_of(config)
    adopt_nf4_layers(model)  # a model that arrives with torchao NF4 weights: placed and saved as paratrain's own
    if held is not None and wanted is not None:
        raise AdapterError("the config has a `peft` section but the model already holds adapters (a peft model): "
                           "remove the section to train the model's own adapters, or pass the base model")
    if wanted is not None:
        layers = inject_adapters(model, wanted, config.seed)
        section = config.peft
        if section.quantize_base is not None and section.quantize_backend == "torchao":
            quantize_nf4_bases(layers)  # torchtune's QLoRA: torchao's NF4, whole, before any split
        elif section.quantize_base is not None:  # QLoRA: the bases to 4 bits, whole, before any split
            quantize_bases(layers, section.quantize_base, section.double_quant)
        return wanted
    if held is None and lora_layers(model):
        raise AdapterError(f"{type(model).__name__} holds paratrain adapter layers that no spec describes; put them "
                           f"in with the `peft` config section")
    return held


def adapted_model(model: nn.Module, config: Config) -> tuple[nn.Module, AdapterSettings | None, dict | None]:
    """The module the engine trains for `model` (its spec's `adapt`: a transformers model's layered view), its
    adapters (`prepare_adapters`) and its own config (a Hugging Face config.json, which checkpoints keep)."""
    model = spec_for(model).adapt(model)
    spec = spec_for(model)
    return model, prepare_adapters(model, config, spec), spec.model_config(model)


def adapted_names(name_map, tensors: list):
    """The weights' names mapped to an adapted model's (original names): `name_map` first (the user's), then a
    base tensor's name without adapters to its name under them ("q_proj.weight" -> "q_proj.base_layer.weight").
    Unchanged for a model without adapters (`tensors`: its `AdapterTensor`s)."""
    if not tensors:
        return name_map
    layers = {t.name.split(".lora_A.")[0] for t in tensors if t.kind == "lora_A"}
    under = {f"{path}.{leaf}": f"{path}.base_layer.{leaf}" for path in layers for leaf in ("weight", "bias")}

    def mapped(name: str) -> str | None:
        if callable(name_map):
            name = name_map(name)
        elif name_map is not None:
            name = name_map.get(name, name)
        return None if name is None else under.get(name, name)

    return mapped


def check_same_adapters(config: dict, settings: AdapterSettings, directory) -> None:
    """Refuse an adapter directory whose adapter_config.json describes other adapters than the model's."""
    theirs = settings_from_config(config, settings.adapter_name)
    for field in ("method", "r", "alpha", "rslora", "bias"):
        if getattr(theirs, field) != getattr(settings, field):
            raise AdapterError(f"the adapter in '{directory}' has {field} = {getattr(theirs, field)!r} but the model's "
                               f"adapters have {getattr(settings, field)!r}; set peft.{field} to "
                               f"{getattr(theirs, field)!r} (or leave it out: peft.load takes the directory's)")

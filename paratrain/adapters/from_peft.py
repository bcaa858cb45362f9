"""A model made by `peft.get_peft_model` (or `PeftModel.from_pretrained`), taken as it comes.

    settings = convert_peft_model(peft_model)    # in place: peft's LoRA layers become paratrain's LoraLinear
    inner = peft_model.base_model.model            # the transformers model, now holding LoraLinear layers

Each peft `lora.Linear` is replaced, under its own name, by a `LoraLinear` that takes over its very children
(`base_layer`, `lora_A`, `lora_B`, `lora_dropout`, and DoRA's magnitude parameter), so every parameter object and
name stays what peft made and the optimizer groups a user built from `peft_model.parameters()` still hold. A
`ModulesToSaveWrapper` (peft's `modules_to_save`) becomes the trainable copy it wraps (the frozen original is
dropped; peft saves the copy under the module's plain name, as paratrain does). What paratrain does not train is
refused by name: other peft methods, LoRA on embeddings or convolutions, merged or several active adapters.
Nothing here imports peft: the layers are recognized by what they hold.
"""

from __future__ import annotations

from torch import nn

from paratrain.adapters.inject import AdapterError, is_linear
from paratrain.adapters.lora import LoraLinear, Magnitude
from paratrain.adapters.quantized import is_4bit_linear, keep_4bit_layout
from paratrain.adapters.settings import AdapterSettings


def is_peft_model(model: nn.Module) -> bool:
    """A `peft.PeftModel` (any task type), found without importing peft."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in type(model).__mro__)


def _peft_class(module: nn.Module) -> str | None:
    cls = type(module)
    return cls.__name__ if cls.__module__.startswith("peft.") else None


def _settings(peft_model: nn.Module, adapter: str) -> AdapterSettings:
    config = peft_model.peft_config[adapter]
    kind = str(getattr(config, "peft_type", ""))
    if "LORA" not in kind.upper() or kind.upper().endswith(("ADALORA", "LORAFA")):
        raise AdapterError(f"the peft model's adapter '{adapter}' is {kind}: paratrain trains LoRA and DoRA adapters "
                           f"(peft.LoraConfig); use a LoraConfig, or paratrain's `peft` config section")
    targets = config.target_modules
    init = config.init_lora_weights
    return AdapterSettings(
        target_modules=targets if isinstance(targets, str) else tuple(sorted(targets or ())),
        method="dora" if config.use_dora else "lora", r=config.r, alpha=config.lora_alpha,
        dropout=config.lora_dropout, rslora=config.use_rslora, bias=bool(getattr(config, "lora_bias", False)),
        init="gaussian" if init == "gaussian" else "default",
        target_parameters=tuple(getattr(config, "target_parameters", None) or ()),
        modules_to_save=tuple(config.modules_to_save or ()), adapter_name=adapter,
        base_model_name_or_path=getattr(config, "base_model_name_or_path", None), extra=config.to_dict())


def _refuse(name: str, module: nn.Module, why: str) -> None:
    raise AdapterError(f"peft model: '{name}' is peft's {type(module).__name__}: {why}")


def _convert_lora_layer(name: str, module: nn.Module, adapter: str) -> LoraLinear:
    if getattr(module, "merged_adapters", None):
        _refuse(name, module, "its adapter is merged into the base weight; call peft_model.unmerge_adapter() first")
    if list(getattr(module, "active_adapters", [adapter])) != [adapter]:
        _refuse(name, module, f"adapters {module.active_adapters} are active; paratrain trains one at a time "
                              f"(peft_model.set_adapter(name))")
    if len(module.lora_embedding_A) or not (is_linear(module.base_layer) or is_4bit_linear(module.base_layer)):
        _refuse(name, module, "paratrain's adapters wrap linear layers only; leave embeddings and convolutions out of "
                              "target_modules")
    if adapter in getattr(module, "lora_variant", {}) and adapter not in module.lora_magnitude_vector:
        _refuse(name, module, f"the LoRA variant {type(module.lora_variant[adapter]).__name__} is not one paratrain "
                              f"trains (LoRA, rsLoRA and DoRA are)")
    if is_4bit_linear(module.base_layer) and len(module.lora_magnitude_vector):
        _refuse(name, module, "DoRA over a 4-bit base is not built (its magnitude needs the base's row norms); use "
                              "LoRA (use_dora=False) over the 4-bit base")
    layer = LoraLinear(module.base_layer, adapter)
    layer.lora_A, layer.lora_B, layer.lora_dropout = module.lora_A, module.lora_B, module.lora_dropout
    for key, dora in module.lora_magnitude_vector.items():
        layer.lora_magnitude_vector[key] = Magnitude(dora.weight.data)
        layer.lora_magnitude_vector[key].weight = dora.weight  # the very parameter: groups built from it still hold
    layer.scaling, layer.ranks, layer.alphas = dict(module.scaling), dict(module.r), dict(module.lora_alpha)
    layer.train(module.training)
    return layer


def convert_peft_model(peft_model: nn.Module) -> AdapterSettings:
    """Replace peft's layers inside `peft_model` by paratrain's (in place; see the module note) and return the
    adapter's settings (its LoraConfig). The transformers model is then `peft_model.base_model.model`."""
    adapter = peft_model.active_adapter
    if not isinstance(adapter, str):
        raise AdapterError(f"peft model: adapters {adapter} are active; paratrain trains one at a time "
                           f"(peft_model.set_adapter(name))")
    settings = _settings(peft_model, adapter)
    inner = peft_model.base_model.model
    keep_4bit_layout(inner)
    for name, module in list(inner.named_modules()):
        kind = _peft_class(module)
        if kind is None or not name:
            continue
        if kind in ("Linear", "Linear4bit") and hasattr(module, "lora_A"):  # 4-bit: QLoRA (adapters/quantized.py)
            new = _convert_lora_layer(name, module, adapter)
        elif kind == "ModulesToSaveWrapper":
            new = module.modules_to_save[adapter]
        elif kind == "ParamWrapper":
            _refuse(name, module, "LoRA on a parameter (target_parameters) is trained through paratrain's `peft` "
                                  "section (peft.target_parameters), not from a peft model")
        elif hasattr(module, "lora_A"):
            _refuse(name, module, "paratrain's adapters wrap linear layers only; leave embeddings, convolutions and "
                                  "quantized layers out of target_modules")
        elif isinstance(module, (nn.ModuleDict, nn.ParameterDict)) or kind.startswith(("Dora", "BufferDict")):
            continue  # the containers inside a LoRA layer, taken over with it
        else:
            _refuse(name, module, "not a layer paratrain can train; use peft.LoraConfig on linear layers")
        parent, _, leaf = name.rpartition(".")
        setattr(inner.get_submodule(parent) if parent else inner, leaf, new)
    return settings

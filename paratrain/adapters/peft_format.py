"""peft's adapter format, by name: `adapter_config.json` and `adapter_model.safetensors` under peft's keys.

    peft_key("model.layers.0.self_attn.q_proj.lora_A.default.weight", "default")
        -> "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

peft saves an adapter under the model's names behind the prefix of its wrapper (`base_model.model.`), without
the adapter's name (`lora_A.weight`), DoRA's magnitude as `lora_magnitude_vector` (no `.weight`), and the whole
modules of `modules_to_save` under their plain names. Nothing here reads or writes files: the streams that do
are `paratrain.checkpoint.adapters`.
"""

from __future__ import annotations

import json
import re

from paratrain.adapters.settings import AdapterSettings

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_magnitude_vector")


def is_adapter_name(name: str) -> bool:
    """A tensor of an adapter (A, B or DoRA's magnitude), by its model name."""
    return any(f".{part}." in name for part in ADAPTER_PARTS)


def peft_key(name: str, adapter: str) -> str:
    """The key peft saves the model's tensor `name` under."""
    name = name.replace(f".lora_magnitude_vector.{adapter}.weight", ".lora_magnitude_vector")
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.{adapter}.", f".{part}.")
    return PREFIX + name


def model_name(key: str, adapter: str) -> str:
    """The model's name of peft's key (the inverse of `peft_key`)."""
    name = key.removeprefix(PREFIX)
    if name.endswith(".lora_magnitude_vector"):
        return f"{name}.{adapter}.weight"
    return re.sub(r"\.(lora_A|lora_B)\.", lambda m: f".{m.group(1)}.{adapter}.", name)


def _jsonable(value):
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value if isinstance(value, (str, int, float, bool, list)) or value is None else str(value)


def adapter_config(settings: AdapterSettings, adapted: list[str]) -> str:
    """adapter_config.json: a peft model's own LoraConfig where the adapter came from one, else paratrain's settings
    in peft's keys, `target_modules` listing the adapted modules by their full names (which peft matches
    exactly, whatever patterns the `peft` section used)."""
    if settings.extra:
        config = {**_jsonable(settings.extra), "inference_mode": True}
    else:
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.r, "lora_alpha": settings.alpha,
                  "lora_dropout": settings.dropout, "use_dora": settings.dora, "use_rslora": settings.rslora,
                  "lora_bias": settings.bias, "bias": "none", "fan_in_fan_out": False,
                  "init_lora_weights": "gaussian" if settings.init == "gaussian" else True,
                  "target_modules": sorted(adapted), "modules_to_save": list(settings.modules_to_save) or None,
                  "target_parameters": list(settings.target_parameters) or None,
                  "base_model_name_or_path": settings.base_model_name_or_path, "inference_mode": True,
                  "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None}
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def settings_from_config(config: dict, adapter: str = "default") -> AdapterSettings:
    """An adapter directory's adapter_config.json as settings (to put the same adapters into a model)."""
    targets = config.get("target_modules") or ()
    return AdapterSettings(
        target_modules=targets if isinstance(targets, str) else tuple(targets),
        method="dora" if config.get("use_dora") else "lora", r=int(config.get("r", 8)),
        alpha=float(config.get("lora_alpha", 8)), dropout=float(config.get("lora_dropout", 0.0)),
        rslora=bool(config.get("use_rslora")), bias=bool(config.get("lora_bias")),
        init="gaussian" if config.get("init_lora_weights") == "gaussian" else "default",
        modules_to_save=tuple(config.get("modules_to_save") or ()), adapter_name=adapter,
        target_parameters=tuple(config.get("target_parameters") or ()),
        base_model_name_or_path=config.get("base_model_name_or_path"))

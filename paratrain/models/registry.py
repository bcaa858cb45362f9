"""Built-in models by preset name: `paratrain train` and the planner build or size any family's preset."""

from __future__ import annotations

from torch import nn

from paratrain.errors import InvalidValueError
from paratrain.models.gpt.model import GPT, gpt_config
from paratrain.models.gpt.model import PRESETS as GPT_PRESETS
from paratrain.models.llama.model import PRESETS as LLAMA_PRESETS
from paratrain.models.llama.model import Llama, llama_config
from paratrain.models.llama_moe.model import PRESETS as LLAMA_MOE_PRESETS
from paratrain.models.llama_moe.model import LlamaMoE, llama_moe_config

FAMILIES = {"gpt": (GPT_PRESETS, gpt_config, GPT), "llama": (LLAMA_PRESETS, llama_config, Llama),
            "llama-moe": (LLAMA_MOE_PRESETS, llama_moe_config, LlamaMoE)}


def _family(preset: str):
    for presets, config, cls in FAMILIES.values():
        if preset in presets:
            return config, cls
    known = [name for presets, _, _ in FAMILIES.values() for name in presets]
    raise InvalidValueError(f"unknown model preset {preset!r}; choose one of {', '.join(known)}")


def preset_config(preset: str, **overrides):
    """The config (GPTConfig, LlamaConfig or LlamaMoEConfig) of a preset, with fields replaced."""
    config, _ = _family(preset)
    return config(preset, **overrides)


def build_model(preset: str, **overrides) -> nn.Module:
    """The model of a preset (GPT, Llama or LlamaMoE), with config fields replaced."""
    _, cls = _family(preset)
    return cls(preset, **overrides)

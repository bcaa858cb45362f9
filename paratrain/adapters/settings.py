"""What an adapter is: its method, rank, scaling and targets (the `peft` config section, or a peft LoraConfig)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch

METHODS = ("lora", "dora")
INITS = ("default", "gaussian")


@dataclass(frozen=True)
class AdapterSettings:
    """One adapter over a model. `target_modules` follows peft: a list of names, each matching a module whose
    name is it or ends with "." + it (or, with a wildcard, a dotted pattern where `*` is one name and `**` any
    number), or a single string, a regular expression the whole module name must match."""

    target_modules: tuple[str, ...] | str = ()
    method: str = "lora"
    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    rslora: bool = False
    bias: bool = False  # a trainable bias on B (peft's lora_bias)
    init: str = "default"
    target_parameters: tuple[str, ...] = ()  # expert stacks (E, out, in), peft's convention
    modules_to_save: tuple[str, ...] = ()  # whole modules trained too (a new head, say)
    adapter_name: str = "default"
    base_model_name_or_path: str | None = None
    extra: dict = field(default_factory=dict)  # peft config keys kept as they came (written back on save)

    @property
    def dora(self) -> bool:
        return self.method == "dora"

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r


def adapter_generator(seed: int, name: str) -> torch.Generator:
    """The generator that draws the adapter `name`'s initial A: a function of the seed and the tensor's name
    only, so eager construction, deferred initialization and every layout draw the same values."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))

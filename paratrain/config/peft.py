"""The `peft` section: low-rank adapters that paratrain puts into the model itself (no peft package needed).

    "peft": {"method": "lora", "r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}

peft's own names are accepted for the keys they share (`lora_alpha`, `lora_dropout`, `use_rslora`, `lora_bias`).
A model that already holds adapters (a `peft.PeftModel`) needs no section: its LoraConfig says the same.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator

from paratrain.config.section import Section
from paratrain.errors import InvalidValueError


class PeftConfig(Section):
    method: Literal["lora", "dora"] = "lora"
    """"lora" (W + s·B·A) or "dora" (LoRA plus a learned magnitude of each output row)."""
    r: int = Field(8, ge=1)
    """The rank of every adapter."""
    alpha: float = Field(8.0, gt=0.0, validation_alias=AliasChoices("alpha", "lora_alpha"))
    """The scaling is alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0, validation_alias=AliasChoices("dropout", "lora_dropout"))
    """Dropout on the adapter's input while training (0: none, and the adapters are exact in every layout)."""
    rslora: bool = Field(False, validation_alias=AliasChoices("rslora", "use_rslora"))
    """Rank-stabilized scaling alpha / sqrt(r)."""
    bias: bool = Field(False, validation_alias=AliasChoices("bias", "lora_bias"))
    """A trainable bias on B (peft's lora_bias)."""
    init: Literal["default", "gaussian"] = "default"
    """A's initial values: "default" is nn.Linear's (kaiming-uniform), "gaussian" N(0, 1/r); B starts at zero, so the
    adapted model starts as the base. Drawn from `seed` and each tensor's name: the same in every layout."""
    target_modules: list[str] | str = Field(default_factory=list)
    """The linear layers to adapt, as peft takes them: names ("q_proj" matches every module named so, or whose name
    ends with ".q_proj"), dotted patterns with wildcards ("model.layers.*.self_attn.q_proj"), or one string that is
    a regular expression the whole module name must match."""
    target_parameters: list[str] = Field(default_factory=list)
    """Expert stacks (E, out, in) to adapt, by parameter name as peft's `target_parameters` takes them
    ("mlp.experts.gate_proj"): each expert gets its own A and B (paratrain's MoE experts; LoRA only)."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained whole beside the adapters (a new head, say), saved with them."""
    adapter_name: str = "default"
    """The adapter's name (peft's key infix: lora_A.<name>.weight)."""
    quantize_base: Literal["nf4", "fp4"] | None = None
    """QLoRA: the adapted layers' frozen bases quantized to 4 bits by bitsandbytes (the `qlora` extra) once, when the
    engine puts the adapters in, each whole tensor before any layout touches it: "nf4" or "fp4" (None: as they are).
    Trains in DDP, ZeRO-1/2/3, pipelines, context parallelism and tensor parallelism where each rank's slice is whole
    blocks of 64 values; not with DoRA or a model on the meta device."""
    double_quant: bool = False
    """With quantize_base: the blocks' scales quantized again (bitsandbytes' double quantization; torchao's NF4
    always quantizes them again, so quantize_backend "torchao" needs it true)."""
    quantize_backend: Literal["bitsandbytes", "torchao"] = "bitsandbytes"
    """With quantize_base: who quantizes. "bitsandbytes" (nf4 or fp4, the `qlora` extra) makes the `Linear4bit`
    layers a transformers model loaded in 4 bits has; "torchao" makes torchao's `NF4Tensor` weights as torchtune does
    (nf4 with double quantization; each weight a multiple of 16384 values). Both train in DDP, ZeRO-1/2/3, pipelines
    and tensor parallelism where each rank's slice is whole blocks of 64 values."""
    load: str | None = None
    """An adapter directory (adapter_config.json + adapter_model.safetensors, peft's format) whose adapter
    weights are loaded into the model's adapters before training, to continue training it in any layout."""

    @model_validator(mode="after")
    def _torchao_is_nf4_double(self) -> PeftConfig:
        """torchao's NF4 has one form: nf4 values, scales quantized again."""
        if self.quantize_backend != "torchao" or self.quantize_base is None:
            return self
        if self.quantize_base != "nf4":
            raise InvalidValueError(f"peft.quantize_base {self.quantize_base!r} with peft.quantize_backend 'torchao': "
                                    f"torchao quantizes to nf4 only; set quantize_base 'nf4', or quantize_backend "
                                    f"'bitsandbytes'")
        if not self.double_quant:
            raise InvalidValueError("peft.double_quant false with peft.quantize_backend 'torchao': torchao's NF4 "
                                    "always quantizes the blocks' scales again; set peft.double_quant true, or "
                                    "quantize_backend 'bitsandbytes'")
        return self

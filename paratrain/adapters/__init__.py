"""Parameter-efficient fine-tuning: low-rank adapters (LoRA, rsLoRA, DoRA) over frozen linear layers.

`LoraLinear` is the layer (peft's children and names); `inject_adapters` puts adapters into any model from
`AdapterSettings` (the `peft` config section); `convert_peft_model` takes a `peft.PeftModel` as it comes. The
strategies treat the frozen base like any weight (ZeRO-3 shards it, tensor parallelism splits it) and give the
adapters their own tensor-parallel styles (`paratrain.parallel.tp.lora`).
"""

from paratrain.adapters.from_peft import convert_peft_model, is_peft_model
from paratrain.adapters.inject import AdapterError, inject_adapters, matched_modules
from paratrain.adapters.lora import LoraLinear, Magnitude, adapters_disabled, lora_layers
from paratrain.adapters.settings import AdapterSettings, adapter_generator

__all__ = ["AdapterError", "AdapterSettings", "LoraLinear", "Magnitude", "adapter_generator", "adapters_disabled",
           "convert_peft_model", "inject_adapters", "is_peft_model", "lora_layers", "matched_modules"]

"""4-bit frozen bases (QLoRA), recognized by what they hold (without importing bitsandbytes), or made here from the
`peft` section's `quantize_base` (which imports it: the `qlora` extra).

A bitsandbytes `Linear4bit` is an `nn.Linear` whose weight is a `Params4bit`: the packed 4-bit values as uint8 (two
per byte) with a `quant_state` beside them (each block's scale, the quantization type, the full shape, and with
double quantization the scales' own scales). Its forward dequantizes that weight and multiplies.

[Note: a 4-bit base in the layouts]
paratrain keeps such a layer as it comes and never re-quantizes or casts it: every forward runs bitsandbytes' own
dequantization of the very bytes one process holds, so every rank computes what one process computes, bit for bit.
DDP, ZeRO-1 and ZeRO-2 (they shard only what trains) and context parallelism keep it whole; a pipeline stage keeps
its whole layers; ZeRO-3 shards its packed bytes and its blocks' scales in buffers of their own per unit, gathered
with the unit (parallel/dp/frozen.py), and keeps the rest of its quantization state (code books) whole. Tensor
parallelism, which would split the weight along a dimension and drop the `quant_state` (a block of 64 values and its
scale must stay together), is refused by name before anything changes (`check_quantized_layout`).
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config.errors import ConfigError


def is_4bit_weight(tensor: torch.Tensor) -> bool:
    """A bitsandbytes `Params4bit` (or anything like it): packed uint8 data with a quant_state beside it."""
    return tensor.dtype == torch.uint8 and getattr(tensor, "quant_state", None) is not None


def is_4bit_linear(module: nn.Module) -> bool:
    """A bitsandbytes `Linear4bit` (or anything holding its kind of weight)."""
    weight = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) and isinstance(weight, torch.Tensor) and is_4bit_weight(weight)


def quantization_state(weight: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a 4-bit weight's quantization state, held beside its packed data: each block's scale (`absmax`)
    and the code book; with double quantization also the scales' own scales, code book and offset. Empty for any
    other tensor."""
    state = getattr(weight, "quant_state", None)
    if state is None:
        return []
    nested = getattr(state, "state2", None)
    parts = [state.absmax, state.code, getattr(state, "offset", None)]
    if nested is not None:
        parts += [nested.absmax, nested.code]
    return [t for t in parts if isinstance(t, torch.Tensor)]


def four_bit_layers(model: nn.Module) -> list[str]:
    """The names of the model's 4-bit linear layers, in module order."""
    return [name for name, module in model.named_modules() if is_4bit_linear(module)]


def keep_4bit_layout(model: nn.Module) -> None:
    """Turn off bitsandbytes' CPU repacking of each 4-bit layer: on a CPU with AVX512-BF16, the first forward in eval
    mode without gradients rewrites the packed weight in place into a CPU-only layout, after which ranks that
    evaluated and ranks that did not would hold different bases, and a checkpoint a layout only that CPU reads.
    Every forward then dequantizes the packed weight as training does."""
    for module in model.modules():
        if is_4bit_linear(module) and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def quantize_bases(layers: list[tuple[str, nn.Module]], quant_type: str, double: bool) -> None:
    """Replace each adapter layer's frozen `base_layer` (an nn.Linear) by a bitsandbytes `Linear4bit` holding its
    weight quantized whole, as `from_pretrained(..., load_in_4bit=True)` quantizes it (bit for bit), computing in the
    weight's dtype. `layers`: (name, LoraLinear)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("peft.quantize_base needs bitsandbytes: pip install 'paratrain[qlora]'") from None
    for name, layer in layers:
        base = layer.base_layer
        if type(base) is not nn.Linear:
            raise ConfigError(f"peft.quantize_base quantizes nn.Linear bases, and '{name}' has a "
                              f"{type(base).__name__}; leave it out of target_modules or remove quantize_base")
        if base.weight.is_meta:
            raise ConfigError(f"peft.quantize_base quantizes the base's values, and '{name}' is on the meta device "
                              f"(a deferred model, filled later): build the model with its weights, or remove "
                              f"quantize_base")
        quantized = bnb.nn.Linear4bit(base.in_features, base.out_features, bias=base.bias is not None,
                                      compute_dtype=base.weight.dtype, quant_type=quant_type, device="meta")
        quantized.weight = bnb.nn.Params4bit(base.weight.detach().clone(), requires_grad=False, quant_type=quant_type,
                                             compress_statistics=double).to(base.weight.device)
        if base.bias is not None:
            quantized.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=False)
        keep_4bit_layout(quantized)
        layer.base_layer = quantized


def check_quantized_layout(model: nn.Module, tp: int) -> None:
    """Refuse, naming the field and the fix, a layout that would cut a 4-bit base (the module note)."""
    layers = four_bit_layers(model) if tp > 1 else []
    if layers:
        where = f"the bitsandbytes Linear4bit '{layers[0]}'" + (f" and {len(layers) - 1} more" if len(layers) > 1
                                                                else "")
        raise ConfigError(f"tensor_parallel.size {tp} over a 4-bit base ({where}) is not built"
                          f": splitting its packed 4-bit weight would drop its quantization state; use "
                          f"tensor_parallel.size 1 with data, pipeline or context parallelism")

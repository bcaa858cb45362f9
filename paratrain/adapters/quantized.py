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
with the unit (parallel/dp/frozen.py), and the rest of the quantization state the state dict holds as itself
(`held_state`: the code book, the scales' own scales); only the scales' code book and offset stay whole.

Tensor parallelism splits the packed bytes by rows (colwise) or columns (rowwise) of the matrix they encode, only
where every block of `blocksize` consecutive values (row-major) stays on one rank with its scale (`block_cut` names
the layer and the fix otherwise): a colwise slice is a contiguous run of whole blocks, a rowwise slice whole blocks
of every row. Each tp rank keeps the whole quantization state (the scales are 1/8 of the packed bytes for nf4,
about 1/32 with double quantization), so a checkpoint stores it as one process does; each forward takes this
slice's scales from it (`local_quant_state`, with double quantization dequantizing the scales exactly as bitsandbytes
does in each forward) and runs bitsandbytes' matmul on the slice. In every layout a checkpoint describes the packed
bytes as that matrix, (rows, columns/2) (`packed_matrix_shape`), so any layout finds its slice.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.adapters.torchao_nf4 import is_nf4_weight, nf4_parts
from paratrain.config.errors import ConfigError


def is_4bit_weight(tensor: torch.Tensor | None) -> bool:
    """A bitsandbytes `Params4bit` (or anything like it): packed uint8 data with a quant_state beside it."""
    return isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8 \
        and getattr(tensor, "quant_state", None) is not None


def is_4bit_linear(module: nn.Module) -> bool:
    """A bitsandbytes `Linear4bit` (or anything holding its kind of weight)."""
    weight = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) and isinstance(weight, torch.Tensor) and is_4bit_weight(weight)


def quantization_state(weight: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a 4-bit weight's quantization state, held beside its packed data: each block's scale (`absmax`)
    and the code book; with double quantization also the scales' own scales, code book and offset. Empty for any
    other tensor."""
    if getattr(weight, "nf4_scales", None) is not None:  # a tensor-parallel slice of a torchao NF4 weight
        return weight.nf4_scales.tensors()
    state = getattr(weight, "quant_state", None)
    if state is None:
        return []
    nested = getattr(state, "state2", None)
    parts = [state.absmax, state.code, getattr(state, "offset", None)]
    if nested is not None:
        parts += [nested.absmax, nested.code]
    return [t for t in parts if isinstance(t, torch.Tensor)]


def encoded_values(tensor: torch.Tensor) -> int | None:
    """The number of values a 4-bit weight encodes, two per packed byte (what it counts as parameters); None for any
    other tensor."""
    if getattr(tensor, "nf4_scales", None) is not None:  # a tensor-parallel slice of a torchao NF4 weight: the whole's
        return math.prod(tensor.nf4_scales.shape)
    return math.prod(tensor.quant_state.shape) if is_4bit_weight(tensor) else None


def held_state(weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The quantization-state tensors bitsandbytes' state dict stores as the very tensors the weight holds, under
    their state-dict names beside `weight.`: each block's scale (`absmax`), the code book (`quant_map`) and with
    double quantization the scales' own scales (`nested_absmax`). ZeRO-3 shards these; the rest (the scales' code
    book, which the state dict copies, and the offset, which it stores as a number) stays whole."""
    state = getattr(weight, "quant_state", None)
    if state is None:
        return []
    nested = getattr(state, "state2", None)
    held = [("absmax", state.absmax), ("quant_map", state.code)]
    return held + ([("nested_absmax", nested.absmax)] if nested is not None else [])


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `tensor`'s bytes: a torchao NF4Tensor's parts (adapters/torchao_nf4.py), else the
    tensor itself."""
    return [t for _, t in nf4_parts(tensor)] if is_nf4_weight(tensor) else [tensor]


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
        if layer.is_dora():
            raise ConfigError(f"peft.quantize_base with DoRA ('{name}'): DoRA's magnitude needs the base's row norms, "
                              f"which are not built over a 4-bit base; use peft.method 'lora', or remove "
                              f"quantize_base")
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


def packed_matrix_shape(weight: torch.Tensor) -> tuple[int, int] | None:
    """The shape of the matrix a 4-bit weight's packed bytes encode, two values per byte along a row:
    (rows, columns / 2); None for any other tensor, or one whose rows have an odd number of values."""
    if getattr(weight, "nf4_matrix", None) is not None:  # a torchao NF4 weight's packed bytes (torchao_nf4.py)
        return weight.nf4_matrix
    if not is_4bit_weight(weight):
        return None
    shape = tuple(weight.quant_state.shape)
    if len(shape) != 2 or shape[1] % 2:
        return None
    return shape[0], shape[1] // 2


def block_cut(name: str, linear: nn.Module, style: str, tp: int) -> str | None:
    """Why splitting the 4-bit `linear` (the adapter layer `name`) over `tp` ranks in `style` would cut one of its
    blocks (the module note); None where every slice is whole blocks."""
    rows, cols = linear.weight.quant_state.shape
    block = linear.weight.quant_state.blocksize
    if style == "colwise":
        per_rank, what = rows // tp * cols, f"{rows // tp} rows of {cols} values ({rows // tp * cols} values)"
    else:
        per_rank, what = cols // tp, f"{cols // tp} of the {cols} columns of each row"
    if per_rank % block == 0 and (style == "colwise" or cols % block == 0):
        return None
    return (f"tensor_parallel.size {tp} gives each rank {what} of the 4-bit base of '{name}' ({style}), which cuts "
            f"its blocks of {block} values (each block and its scale must stay on one rank): choose a "
            f"tensor_parallel.size whose slices are whole blocks, or leave '{name}' out of peft.target_modules "
            f"and of the tensor-parallel plan")


def local_quant_state(state, style: str, index: int, parts: int):
    """The quantization state of slice `index` of `parts` (rows for colwise, columns for rowwise) of a 4-bit weight
    whose whole state is `state`: the slice's shape and its blocks' fp32 scales (with double quantization, the
    scales bitsandbytes computes from their own scales in every forward, bit for bit), without nesting."""
    rows, cols = state.shape
    scales = state.absmax
    if state.nested:  # as bitsandbytes' gemm does before each product: code2[absmax] * absmax2[i // 256] + offset
        scales = torch.ops.bitsandbytes.dequantize_blockwise.default(
            state.absmax, state.state2.absmax, state.state2.code, state.state2.blocksize, torch.float32) + state.offset
    scales = scales.float()
    if style == "colwise":
        step = scales.numel() // parts
        local, shape = scales[index * step:(index + 1) * step], (rows // parts, cols)
    else:
        step = cols // parts // state.blocksize
        local = scales.view(rows, -1)[:, index * step:(index + 1) * step].reshape(-1)
        shape = (rows, cols // parts)
    return type(state)(absmax=local.contiguous(), shape=torch.Size(shape), code=state.code,
                       blocksize=state.blocksize, quant_type=state.quant_type, dtype=state.dtype)


def check_4bit_dequantization(model: nn.Module) -> None:
    """Refuse, naming the layer, a 4-bit weight on the CPU whose dequantization by bitsandbytes is not its own values:
    bitsandbytes 0.50's CPU kernel miscomputes some widths that are not multiples of 64 (64 x 96 for one; 64 x 128
    is exact). Each (shape, type, blocksize, nesting) is checked
    once, against the format computed here: value = code[4-bit index] · its block's scale."""
    seen = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not is_4bit_weight(weight) or weight.device.type != "cpu" or weight.is_meta:
            continue
        state = weight.quant_state
        key = (tuple(state.shape), state.quant_type, state.blocksize, state.nested, state.dtype)
        if key in seen:
            continue
        seen.add(key)
        import bitsandbytes as bnb

        got = bnb.functional.dequantize_4bit(weight.data.reshape(-1, 1), state)
        if not torch.equal(got, _dequantized(weight.data, state)):
            raise ConfigError(f"bitsandbytes' CPU dequantization of the 4-bit weight of '{name}' (shape "
                              f"{list(state.shape)}, {state.quant_type}) does not give its own 4-bit values: "
                              f"bitsandbytes' CPU kernel miscomputes some widths that are not multiples of "
                              f"{state.blocksize}; use layers whose in_features are multiples of {state.blocksize}, "
                              f"leave '{name.removesuffix('.base_layer')}' out of the 4-bit quantization (and of "
                              f"peft.target_modules with quantize_base), or train on a GPU")


def _dequantized(packed: torch.Tensor, state) -> torch.Tensor:
    """A 4-bit weight's values by its format alone: two 4-bit indices per byte (the high half first) into the code
    book, each times its block's fp32 scale (`local_quant_state` of the whole weight gives them as bitsandbytes
    computes them)."""
    n = math.prod(state.shape)
    data = packed.reshape(-1)
    indices = torch.stack([data >> 4, data & 0xF], dim=-1).reshape(-1)[:n].long()
    scales = local_quant_state(state, "colwise", 0, 1).absmax
    values = state.code[indices].view(-1) * scales.repeat_interleave(state.blocksize)[:n]
    return values.to(state.dtype).view(*state.shape)

"""torchao's NF4 bases (QLoRA torchtune's way): a frozen linear weight held as torchao's `NF4Tensor`, recognized by
what it holds (without importing torchao), or made here from the `peft` section (`quantize_backend: "torchao"`, which
imports it: the `qlora` extra).

An NF4Tensor is a tensor subclass over five plain tensors: `quantized_data` (uint8, two 4-bit indices per byte, the
high half first: n/2 bytes), `quantized_scalers` (int8, the scale of each block of 64 values, quantized),
`quantization_factor` (one per 256 blocks, in the weight's dtype), `scaler_mean` (one number) and `nf4` (the code book,
16 values). A value is nf4[index] · (quantized scaler / its factor + mean), computed elementwise in the weight's
dtype: each value depends on its own block only, so a slice of whole blocks dequantizes, bit for bit, as the whole
weight does (`nf4_slice_values`). Its numel must be a multiple of 64 · 256 (torchao quantizes the scales in blocks of
256).

[Note: a torchao NF4 base in the layouts]
paratrain never re-quantizes it. DDP, ZeRO-1/2 and context parallelism keep it whole and run torchao's own forward
(`linear_nf4`). ZeRO-3 shards its three per-block tensors in buffers of their own per unit (parallel/dp/frozen.py),
gathered with the unit into the very tensors the NF4Tensor holds, so torchao's forward runs on one process's bytes;
the mean and the code book stay whole. Tensor parallelism (parallel/tp/quantized.py) holds the rank's rows (colwise)
or columns (rowwise) of the packed bytes, as a box of their (rows, columns/2) matrix, beside the whole scales, and
dequantizes its slice as torchao does, where every slice is whole blocks (`nf4_block_cut` names the layer otherwise).
A pipeline stage keeps its layers whole. Checkpoints store the weight's plain tensors under the layer's names
(`state_key`), the packed bytes located as their matrix, so a checkpoint moves between layouts; a merged save
dequantizes the base as torchao does (checkpoint/adapters.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.config.errors import ConfigError

SHARDED_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")  # one entry per value pair / block
WHOLE_PARTS = ("scaler_mean", "nf4")


def is_nf4_weight(tensor) -> bool:
    """torchao's NF4Tensor (by what it holds: torchao is not imported)."""
    return isinstance(tensor, torch.Tensor) and type(tensor).__name__ == "NF4Tensor" \
        and all(hasattr(tensor, part) for part in SHARDED_PARTS + WHOLE_PARTS)


def nf4_parts(weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The plain tensors an NF4Tensor holds, by name: the per-block ones first (`SHARDED_PARTS`)."""
    return [(part, getattr(weight, part)) for part in SHARDED_PARTS + WHOLE_PARTS]


def state_key(part: str) -> str:
    """The state-dict name of an NF4 weight's part beside the layer's prefix: the packed bytes are `weight` (as a
    bitsandbytes 4-bit layer's are), the rest `weight.<torchao's name>`."""
    return "weight" if part == "quantized_data" else f"weight.{part}"


@dataclass
class NF4Scales:
    """What a tensor-parallel slice of an NF4 weight keeps whole beside its packed bytes (the module note)."""

    quantized_scalers: torch.Tensor
    quantization_factor: torch.Tensor
    scaler_mean: torch.Tensor
    nf4: torch.Tensor
    block_size: int
    scaler_block_size: int
    shape: tuple[int, int]  # the whole weight's
    dtype: torch.dtype

    @classmethod
    def of(cls, weight: torch.Tensor) -> NF4Scales:
        return cls(weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean, weight.nf4,
                   weight.block_size, weight.scaler_block_size, tuple(weight.shape), weight.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.quantized_scalers, self.quantization_factor, self.scaler_mean, self.nf4]

    def scalers(self) -> torch.Tensor:
        """Every block's scale, as torchao's `dequantize_scalers` computes it: int8 / the factor of its 256 blocks,
        in the weight's dtype, plus the mean."""
        grouped = self.quantized_scalers.view(-1, self.scaler_block_size)
        return (grouped / self.quantization_factor.unsqueeze(-1)).flatten().to(self.dtype) + self.scaler_mean


def nf4_slice_values(packed: torch.Tensor, scales: NF4Scales, style: str, index: int, parts: int) -> torch.Tensor:
    """Slice `index` of `parts` of the weight (rows for colwise, columns for rowwise) from its packed bytes `packed`
    (rows, columns/2 of the byte matrix) and the whole scales, as torchao's `get_original_weight` computes each value:
    code[index] · its block's scale, the two halves of a byte interleaved."""
    rows, cols = scales.shape
    per_row = cols // scales.block_size
    scalers = scales.scalers()
    if style == "colwise":
        step = rows // parts * per_row
        local, shape = scalers[index * step:(index + 1) * step], (rows // parts, cols)
    else:
        step = per_row // parts
        local = scalers.view(rows, per_row)[:, index * step:(index + 1) * step].reshape(-1)
        shape = (rows, cols // parts)
    data = packed.reshape(-1)
    repeated = local.unsqueeze(-1).expand(local.numel(), scales.block_size // 2).flatten()
    first = scales.nf4[(data >> 4).long()] * repeated
    second = scales.nf4[(data & 0b1111).long()] * repeated
    return torch.stack([first, second], dim=-1).reshape(shape)


def nf4_block_cut(name: str, weight: torch.Tensor, style: str, tp: int) -> str | None:
    """Why splitting the NF4 base of `name` over `tp` ranks in `style` would cut one of its blocks of 64 values;
    None where every slice is whole blocks."""
    rows, cols = weight.shape
    block = weight.block_size
    if style == "colwise":
        whole, what = rows // tp * cols % block == 0, f"{rows // tp} rows of {cols} values"
    else:
        whole, what = cols // tp % block == 0, f"{cols // tp} of the {cols} columns of each row"
    if whole:
        return None
    return (f"tensor_parallel.size {tp} gives each rank {what} of the NF4 base of '{name}' ({style}), which cuts its "
            f"blocks of {block} values (each block and its scale must stay on one rank): choose a "
            f"tensor_parallel.size whose slices are whole blocks, or leave '{name}' out of peft.target_modules and "
            f"of the tensor-parallel plan")


class NF4Linear(nn.Linear):
    """An nn.Linear whose frozen weight is torchao's NF4Tensor: its forward is torchao's (`F.linear` on an NF4Tensor
    runs `linear_nf4`); its state dict holds the weight's plain tensors (`state_key`): the packed bytes as `weight`,
    as torchao holds them, (n/2,), located as the (rows, columns/2) matrix they encode (`nf4_matrix`) so that every
    layout finds its slice of them, and the rest as `weight.<torchao's name>`."""

    def hold(self, weight: torch.Tensor) -> None:
        self.weight = nn.Parameter(weight, requires_grad=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # marked here, each time: moving the module (`.to`) wraps the weight anew, over new tensors for its parts
        mark_packed(self.weight.quantized_data, tuple(self.weight.shape), whole=True)
        for part, tensor in nf4_parts(self.weight):
            destination[prefix + state_key(part)] = tensor if keep_vars else tensor.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        with torch.no_grad():
            for part, tensor in nf4_parts(self.weight):
                key = prefix + state_key(part)
                if key in state_dict:
                    tensor.copy_(state_dict[key].reshape(tensor.shape))
                else:
                    missing_keys.append(key)
            if self.bias is not None and prefix + "bias" in state_dict:
                self.bias.copy_(state_dict[prefix + "bias"])


def adopt_nf4_layers(model: nn.Module) -> list[str]:
    """Make every linear layer of `model` whose weight is an NF4Tensor (a model that arrives quantized by torchao:
    `to_nf4` on an nn.Linear's weight, torchtune's `FrozenNF4Linear`) an `NF4Linear` holding that very weight, so that
    it is placed, split and saved as paratrain's own; its forward is the same torchao `linear_nf4`. Returns their
    names."""
    adopted = []
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or isinstance(module, NF4Linear) or not is_nf4_weight(weight):
            continue
        layer = NF4Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        layer.hold(compacted(weight.detach()))
        if module.bias is not None:
            layer.bias = module.bias
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
        adopted.append(name)
    return adopted


def mark_packed(data: torch.Tensor, shape: tuple[int, int], whole: bool) -> None:
    """Record on NF4 packed bytes (a plain tensor) the (rows, columns/2) matrix they are (`whole`) or are a box of,
    and the shape torchao holds them in, (n/2,): what checkpoints locate and store them by."""
    rows, cols = shape
    data.nf4_held_shape = (rows * cols // 2,)
    if whole:
        data.nf4_matrix = (rows, cols // 2)


def compacted(weight: torch.Tensor) -> torch.Tensor:
    """`weight` with each part contiguous in a storage of its own size: torchao's `to_nf4` leaves a weight with one
    block of 256 scales holding its 4-byte factor as a view of a 1 KiB tensor (its [:, 0] of 256 equal columns, with
    a stride of 256 that no byte view of it takes)."""
    for part, tensor in nf4_parts(weight):
        fresh = tensor.clone(memory_format=torch.contiguous_format)
        if tensor.untyped_storage().nbytes() > fresh.untyped_storage().nbytes() or tensor.stride() != fresh.stride():
            setattr(weight, part, fresh)
    return weight


def quantize_nf4_bases(layers: list[tuple[str, nn.Module]]) -> None:
    """Replace each adapter layer's frozen `base_layer` by an `NF4Linear` holding torchao's NF4 of its weight
    (`to_nf4`: blocks of 64, the scales quantized per 256 blocks), whole, as torchtune's QLoRA does; every layer is
    checked before any changes. `layers`: (name, LoraLinear)."""
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        raise ConfigError("peft.quantize_backend 'torchao' needs torchao: pip install 'paratrain[qlora]'") from None
    for name, layer in layers:
        _check_quantizable(name, layer)
    for _, layer in layers:
        base = layer.base_layer
        quantized = NF4Linear(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        quantized.hold(compacted(to_nf4(base.weight.detach().clone())))
        if base.bias is not None:
            quantized.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=False)
        layer.base_layer = quantized


def _check_quantizable(name: str, layer: nn.Module) -> None:
    base = layer.base_layer
    if layer.is_dora():
        raise ConfigError(f"peft.quantize_base with DoRA ('{name}'): DoRA's magnitude needs the base's row norms, "
                          f"which are not built over a 4-bit base; use peft.method 'lora', or remove quantize_base")
    if type(base) is not nn.Linear or base.weight.is_meta:
        raise ConfigError(f"peft.quantize_base quantizes the values of nn.Linear bases, and '{name}' has a "
                          f"{type(base).__name__}{' on the meta device' if base.weight.is_meta else ''}; leave it "
                          f"out of target_modules, build the model with its weights, or remove quantize_base")
    if base.weight.numel() % (64 * 256):
        raise ConfigError(f"peft.quantize_backend 'torchao' quantizes weights of a multiple of 64 x 256 = 16384 "
                          f"values (their scales are quantized in blocks of 256 blocks), and '{name}' has "
                          f"{list(base.weight.shape)}: leave it out of peft.target_modules, or use "
                          f"peft.quantize_backend 'bitsandbytes'")

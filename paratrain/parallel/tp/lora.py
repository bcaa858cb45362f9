"""Tensor-parallel styles of an adapter layer (`paratrain.adapters.LoraLinear`): its base and adapters split so that
the layer's own forward, unchanged, computes this rank's part.

    column-parallel base (q, k, v, gate, up):  base W (out/tp, in)    A (r, in) whole     B (out/tp, r)   m (out/tp)
    row-parallel base (o, down):               base W (out, in/tp)    A (r, in/tp)        B (out, r) whole  m (out)

[Note: which gradients are summed over tp]
Column-parallel: every rank feeds the whole activation x (entered into the region once, by the layer's parent or
by the layer itself) through the whole A, and its h = A·x only into its rows of B; so the gradient of h, and the
A gradient dA = dh·xᵀ each rank computes, is its rows' share: A's gradient is summed over tp (`SumOverTp`), exactly
as the region entry sums the input's. B and m hold disjoint rows: nothing to sum. Row-parallel: A splits the input
features like the base and its output (b, s, r) is summed over tp like the base's (an all-reduce, or a
reduce-scatter to the sequence shard under sequence parallelism): r numbers per token, where the base moves out.
B then runs on whole activations, identical on every rank, unless sequence parallelism gives each rank s/tp
tokens: then B's and m's gradients are summed over tp like a norm's. DoRA's row norms ‖W + s·B·A‖ need every
column of a row: the row-parallel layer sums their squares over tp (`LoraLinear.norm_axis`).
"""

from __future__ import annotations

from torch import nn

from paratrain.adapters import LoraLinear, Magnitude
from paratrain.adapters.quantized import block_cut, is_4bit_linear
from paratrain.adapters.torchao_nf4 import is_nf4_weight, nf4_block_cut
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Shard
from paratrain.parallel.tp.layers import ColumnParallelLinear, PlanError, RowParallelLinear, _shard
from paratrain.parallel.tp.quantized import Split4bitLinear, SplitNF4Linear

ADAPTER_STYLES = ("colwise", "rowwise")


class SplitMagnitude(Magnitude):
    """DoRA's magnitude of a column-parallel layer: this rank's rows, (out/tp,)."""

    def __init__(self, magnitude: Magnitude, axis: Axis):
        full = magnitude.weight.shape[0]
        super().__init__(_shard(magnitude.weight.detach(), 0, axis, full))
        self.weight.requires_grad_(magnitude.weight.requires_grad)
        self.placements = {"weight": Shard(0, full)}


def check_adapter_style(path: str, layer: LoraLinear, style: str, parts, tp: int) -> None:
    """Refuse, before anything changes, a style an adapter layer cannot take."""
    if style not in ADAPTER_STYLES:
        raise PlanError(f"'{path}' holds LoRA adapters, which tensor parallelism splits with the styles "
                        f"{list(ADAPTER_STYLES)}, not '{style}'; leave the layer out of peft.target_modules (an output "
                        f"head keeps 'colwise_vocab' without adapters), or set tensor_parallel.size 1")
    if parts:
        raise PlanError(f"'{path}' is a packed projection ({style}:{','.join(map(str, parts))}) with LoRA adapters, "
                        f"which paratrain does not split part by part; adapt the unpacked layers, or set "
                        f"tensor_parallel.size 1")
    base = layer.base_layer
    cut = block_cut(path, base, style, tp) if is_4bit_linear(base) else \
        nf4_block_cut(path, base.weight, style, tp) if is_nf4_weight(getattr(base, "weight", None)) else None
    if cut:
        raise PlanError(cut)


def split_adapter_layer(layer: LoraLinear, path: str, style: str, axis: Axis, sequence_parallel: bool
                        ) -> list[tuple[nn.Module, str]]:
    """Split `layer` in place as `style` says (the module note); returns the (module, parameter name) pairs whose
    gradients are summed over tp. A column-parallel layer's input must already be in the region (the caller
    enters it for the layer when no parent does)."""
    summed: list[tuple[nn.Module, str]] = []
    layer.base_layer = _split_base(layer.base_layer, f"{path}.base_layer", style, axis, sequence_parallel)
    if style == "colwise":
        for name in list(layer.lora_B):
            layer.lora_B[name] = ColumnParallelLinear(layer.lora_B[name], axis, name=f"{path}.lora_B.{name}",
                                                      enter_region=False)
            summed.append((layer.lora_A[name], "weight"))
        for name in list(layer.lora_magnitude_vector):
            layer.lora_magnitude_vector[name] = SplitMagnitude(layer.lora_magnitude_vector[name], axis)
        return summed
    for name in list(layer.lora_A):
        layer.lora_A[name] = RowParallelLinear(layer.lora_A[name], axis, name=f"{path}.lora_A.{name}",
                                               sequence_parallel=sequence_parallel)
    layer.norm_axis = axis
    if sequence_parallel:  # B and m see this rank's s/tp tokens only
        for module in [*layer.lora_B.values(), *layer.lora_magnitude_vector.values()]:
            summed += [(module, n) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
    return summed


def _split_base(base: nn.Module, name: str, style: str, axis: Axis, sequence_parallel: bool) -> nn.Module:
    """The adapter layer's base split as `style` says: a 4-bit base (QLoRA: bitsandbytes', torchao's NF4) at block
    boundaries, keeping its quantization state (tp/quantized.py); a colwise base's input is already in the region."""
    if is_4bit_linear(base):
        return Split4bitLinear(base, style, axis, name=name, sequence_parallel=sequence_parallel)
    if is_nf4_weight(getattr(base, "weight", None)):
        return SplitNF4Linear(base, style, axis, name=name, sequence_parallel=sequence_parallel)
    if style == "colwise":
        return ColumnParallelLinear(base, axis, name=name, enter_region=False, sequence_parallel=sequence_parallel)
    return RowParallelLinear(base, axis, name=name, sequence_parallel=sequence_parallel)

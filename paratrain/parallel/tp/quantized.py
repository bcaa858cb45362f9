"""A 4-bit base layer split over tp (QLoRA): bitsandbytes' `Linear4bit` (adapters/quantized.py, its note) or torchao's
NF4 weight (adapters/torchao_nf4.py, its note): this rank's rows (colwise) or columns (rowwise) of the packed bytes,
the whole quantization state beside them.

    colwise:  packed (out/tp, in/2)  ->  y = x W_rᵀ + b_r                       (b, s, out/tp)
    rowwise:  packed (out, in/tp/2)  ->  y = Σ_tp x_r W_rᵀ, then + b            (b, s, out), or (b, s/tp, out) with SP

The packed slice is held as the 2-d matrix of bytes it is a box of, so that its placement `Shard(dim, whole)` locates
it in the matrix every layout describes (`packed_matrix_shape`); bitsandbytes reads it flat, and the NF4 slice is
dequantized as torchao dequantizes the whole (`nf4_slice_values`, bit for bit). It is frozen: nothing here has a
gradient to sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.adapters.quantized import local_quant_state
from paratrain.adapters.torchao_nf4 import NF4Scales, mark_packed, nf4_slice_values, state_key
from paratrain.comm.autograd import reduce_from_region, reduce_scatter_to_sequence
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Shard
from paratrain.parallel.tp.layers import ACTIVATION_TAG, SEQ_DIM


class _SplitPacked(nn.Module):
    """What both 4-bit slices share: this rank's box of the (rows, columns/2) byte matrix `matrix` as the frozen
    `weight`, a colwise bias split with it (a rowwise bias whole, added after the sum), and the rowwise exit."""

    kind = ""  # the quantizer, for extra_repr

    def __init__(self, linear: nn.Module, matrix: torch.Tensor, style: str, axis: Axis, name: str,
                 sequence_parallel: bool):
        super().__init__()
        self.style, self.axis, self.name, self.sequence_parallel = style, axis, name, sequence_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dim = 0 if style == "colwise" else 1
        self.weight = nn.Parameter(matrix.chunk(axis.size, dim=dim)[axis.rank].clone(), requires_grad=False)
        self.placements = {"weight": Shard(dim, matrix.shape[dim])}
        bias = linear.bias
        if bias is not None and style == "colwise":
            self.placements["bias"] = Shard(0, bias.shape[0])
            bias = bias.detach().chunk(axis.size)[axis.rank]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def colwise_bias(self) -> torch.Tensor | None:
        return self.bias if self.style == "colwise" else None

    def rowwise_exit(self, y: torch.Tensor) -> torch.Tensor:
        """A rowwise slice's partial product summed over tp (reduce-scattered over the sequence with SP), then
        the whole bias; a colwise output as it is."""
        if self.style != "rowwise":
            return y
        y = reduce_scatter_to_sequence(y, self.axis, SEQ_DIM, ACTIVATION_TAG) if self.sequence_parallel \
            else reduce_from_region(y, self.axis, ACTIVATION_TAG)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.style}, tp={self.axis.size}"
                f", {self.kind}, sequence_parallel={self.sequence_parallel}")


class Split4bitLinear(_SplitPacked):
    """This rank's slice of a 4-bit linear layer, computed by bitsandbytes' own 4-bit matmul (the module note).
    `style`: "colwise" or "rowwise"; the caller has checked that the split keeps blocks whole (`block_cut`)."""

    def __init__(self, linear: nn.Module, style: str, axis: Axis, *, name: str = "", sequence_parallel: bool = False):
        state = linear.weight.quant_state
        rows, cols = state.shape
        matrix = linear.weight.detach().view(torch.uint8).reshape(rows, cols // 2)
        super().__init__(linear, matrix, style, axis, name, sequence_parallel)
        self.compute_dtype = getattr(linear, "compute_dtype", None)
        self.weight.quant_state = state  # the whole state, held and saved as one process holds it
        self.kind = f"4-bit {state.quant_type}"

    def _local_state(self):
        """This slice's quantization state, from the whole one as it is now (a load may have rewritten it)."""
        return local_quant_state(self.weight.quant_state, self.style, self.axis.rank, self.axis.size)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The slice and bias, then the whole quantization state under bitsandbytes' names (`weight.absmax`, ...)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, value in self.weight.quant_state.as_dict(packed=True).items():
            destination[prefix + "weight." + key] = value if keep_vars else value.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        y = bnb.matmul_4bit(x, self.weight, quant_state=self._local_state(), bias=self.colwise_bias)
        return self.rowwise_exit(y).to(dtype)


class SplitNF4Linear(_SplitPacked):
    """This rank's slice of a linear layer over a torchao NF4 weight (`NF4Linear`), dequantized as torchao does; the
    state dict keeps the whole layer's names (`state_key`: `weight`, the slice; `weight.quantized_scalers`, ...: whole).
    `style`: "colwise" or "rowwise"; the caller has checked that the split keeps blocks whole (`nf4_block_cut`)."""

    kind = "torchao nf4"

    def __init__(self, linear: nn.Module, style: str, axis: Axis, *, name: str = "", sequence_parallel: bool = False):
        rows, cols = linear.weight.shape
        super().__init__(linear, linear.weight.quantized_data.view(rows, cols // 2), style, axis, name,
                         sequence_parallel)
        self.weight.nf4_scales = NF4Scales.of(linear.weight)  # whole on every tp rank, as one process holds them
        mark_packed(self.weight, (rows, cols), whole=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        scales = self.weight.nf4_scales
        held = {"quantized_data": self.weight, "quantized_scalers": scales.quantized_scalers,
                "quantization_factor": scales.quantization_factor, "scaler_mean": scales.scaler_mean,
                "nf4": scales.nf4}
        for part, tensor in held.items():
            destination[prefix + state_key(part)] = tensor if keep_vars else tensor.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = nf4_slice_values(self.weight, self.weight.nf4_scales, self.style, self.axis.rank, self.axis.size)
        return self.rowwise_exit(F.linear(x, weight.to(x.dtype), self.colwise_bias))

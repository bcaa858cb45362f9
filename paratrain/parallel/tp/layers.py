"""Megatron's tensor-parallel layers, built from a dense layer by slicing (so every rank starts exactly
where the single-process model starts).

Activations are `(batch, sequence, features)`; under sequence parallelism the regions between the
tensor-parallel layers hold `(b, s/tp, h)` and the layers switch between the two layouts:

    (b, s/tp, h) --all-gather--> ColumnParallelLinear --> (b, s, out/tp) ... RowParallelLinear
                 <--reduce-scatter--                          (b, s, h) partial --reduce-scatter--> (b, s/tp, h)

Without sequence parallelism the entry is `copy_to_region` (backward all-reduce) and the exit
`reduce_from_region` (forward all-reduce). Sharded parameters carry the placement `Shard(dim, full)` over
tp (`paratrain.layout.placement`: the global gradient norm and checkpoints read it); `apply.py` marks every other
parameter `Replicate`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.adapters import LoraLinear
from paratrain.comm.autograd import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
)
from paratrain.config.errors import ConfigError
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Shard
from paratrain.weight_grad import linear

SEQ_DIM = 1  # activations are (batch, sequence, features)
ACTIVATION_TAG = "tp"  # entries to and exits from the tensor-parallel regions
GRAD_TAG = "tp_grad"  # gradients of replicated parameters computed from sequence shards
EMBED_TAG = "tp_embed"  # the vocab-parallel embedding's sum over tp


class PlanError(ConfigError):
    """A tensor-parallel plan that cannot be applied, or a model it leaves inconsistent (a config error:
    the plan is the config's `tensor_parallel.plan`)."""


def padded_size(size: int, parts: int) -> int:
    """`size` rounded up to a multiple of `parts` (uneven vocabularies are padded with zero rows)."""
    return math.ceil(size / parts) * parts


def _shard(tensor: torch.Tensor, dim: int, axis: Axis, padded: int) -> torch.Tensor:
    """This rank's slice of `tensor` along `dim` after zero-padding that dimension to `padded`."""
    if padded != tensor.shape[dim]:
        pad_shape = list(tensor.shape)
        pad_shape[dim] = padded - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
    return tensor.chunk(axis.size, dim=dim)[axis.rank].clone()


def _sharded_param(layer: nn.Module, name: str, data: torch.Tensor, requires_grad: bool, kind: Shard) -> None:
    """Register this rank's slice as `layer`'s parameter `name` and declare how it is split over tp in
    `layer.placements` (the tensor-parallel step records it in the parallel model's `Placements`)."""
    layer.register_parameter(name, nn.Parameter(data, requires_grad=requires_grad))
    layer.placements[name] = kind


def _check_width(x: torch.Tensor, expected: int, name: str, style: str, hint: str) -> None:
    if x.shape[-1] != expected:
        raise PlanError(f"tensor-parallel module '{name}' ({style}) expected inputs with {expected} features in "
                        f"the last dimension but got shape {tuple(x.shape)}: {hint}")


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's `Conv1D`: a linear layer whose weight is stored transposed, (in, out)."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor) \
        and module.weight.dim() == 2


def linear_features(module: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, transposed) of an nn.Linear or a Conv1D (an adapter layer: of its base)."""
    if isinstance(module, LoraLinear):
        module = module.base_layer
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1], True
    return module.in_features, module.out_features, False


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the output features split: (b, s, in) -> (b, s, out/tp), or gathered to out.

    `enter_region=False` when a parent already entered the region for several layers sharing one input
    (q, k, v), so the entry's communication happens once. `pad_output` pads uneven output sizes (a
    vocabulary) with zero rows; the vocab-parallel loss masks the padded logits. A Conv1D (weight stored
    (in, out)) keeps its layout: its columns are split. `parts` splits a packed projection (q, k and v in one
    weight, of these output sizes) part by part: each rank keeps its share of every part, as the parameters
    `weight_0, weight_1, ...` (`bias_0, ...`), and outputs [q_r, k_r, v_r].
    """

    def __init__(self, linear: nn.Module, axis: Axis, *, name: str = "", gather_output: bool = False,
                 enter_region: bool = True, sequence_parallel: bool = False, pad_output: bool = False,
                 parts: tuple[int, ...] | None = None):
        super().__init__()
        self.axis, self.name = axis, name
        self.in_features, self.out_features, self.transposed = linear_features(linear)
        self.padded_out_features = padded_size(self.out_features, axis.size) if pad_output else self.out_features
        self.parts = tuple(parts) if parts else None
        if self.padded_out_features % axis.size:
            raise PlanError(f"'{name}' (colwise) has out_features {self.out_features}, not divisible by the "
                            f"tensor-parallel size {axis.size}; choose a tensor_parallel.size that divides it")
        if self.parts and (any(size % axis.size for size in self.parts) or sum(self.parts) != self.out_features):
            raise PlanError(f"'{name}' (colwise) has output parts {list(self.parts)} of {self.out_features} "
                            f"features, which must add up to it and which tensor-parallel size {axis.size} must "
                            f"divide each; choose a tensor_parallel.size that divides each")
        if self.parts and gather_output:
            raise PlanError(f"'{name}': a packed colwise layer cannot gather its output (the parts would "
                            f"interleave); consume it inside the region")
        self.gather_output, self.enter_region, self.sequence_parallel = gather_output, enter_region, sequence_parallel
        dim = 1 if self.transposed else 0  # the output dimension of the weight
        self.placements: dict[str, Shard] = {}
        if self.parts is None:
            _sharded_param(self, "weight", _shard(linear.weight.detach(), dim, axis, self.padded_out_features),
                           linear.weight.requires_grad, Shard(dim, self.out_features))  # (out/tp, in)
            if linear.bias is None:
                self.bias = None
            else:
                _sharded_param(self, "bias", _shard(linear.bias.detach(), 0, axis, self.padded_out_features),
                               linear.bias.requires_grad, Shard(0, self.out_features))
            return
        offset = 0
        for i, size in enumerate(self.parts):
            for attr, tensor, d in (("weight", linear.weight, dim), ("bias", linear.bias, 0)):
                if tensor is None:
                    continue
                _sharded_param(self, f"{attr}_{i}", _shard(tensor.detach().narrow(d, offset, size), d, axis, size),
                               tensor.requires_grad, Shard(d, size, packed=(offset, self.out_features)))
            offset += size

    def local_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's whole weight and bias (a packed projection's parts concatenated)."""
        weights = self._weights()
        weight = weights[0] if len(weights) == 1 else torch.cat(weights, 1 if self.transposed else 0)
        return weight, self._bias()

    def _bias(self) -> torch.Tensor | None:
        if self.parts is None:
            return self.bias
        biases = [getattr(self, f"bias_{i}", None) for i in range(len(self.parts))]
        return None if biases[0] is None else torch.cat(biases)

    def _weights(self) -> list[nn.Parameter]:
        """The projection's weight, or its parts side by side (a packed projection)."""
        if self.parts is None:
            return [self.weight]
        return [getattr(self, f"weight_{i}") for i in range(len(self.parts))]

    def weight_grad_parameters(self) -> list[nn.Parameter]:
        """The weight(s) whose gradient a split backward defers to W (`paratrain.weight_grad`)."""
        return self._weights()

    @property
    def local_out_features(self) -> int:
        return self.padded_out_features // self.axis.size

    @property
    def vocab_start(self) -> int:
        """Global index of this rank's first output (the vocabulary offset of a vocab-parallel head)."""
        return self.axis.rank * self.local_out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = gather_from_sequence(x, self.axis, SEQ_DIM, ACTIVATION_TAG) if self.sequence_parallel \
                else copy_to_region(x, self.axis, ACTIVATION_TAG)  # (b, s, in)
        _check_width(x, self.in_features, self.name, "colwise", "its input must be the full (replicated) "
                     "features; a colwise layer cannot follow another colwise layer directly")
        y = linear(x, self._weights(), self._bias(), transposed=self.transposed,
                   dim=1 if self.transposed else 0)  # (b, s, out/tp)
        if self.gather_output:
            y = gather_from_region(y, self.axis, -1, ACTIVATION_TAG)[..., :self.out_features]  # (b, s, out)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.local_out_features}), tp={self.axis.size}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}" + (f", parts={list(self.parts)}" if self.parts else "")
                + (", transposed" if self.transposed else ""))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input features split: (b, s, in/tp) -> (b, s, out), summed over tp.

    The sum is an all-reduce, or under sequence parallelism a reduce-scatter to (b, s/tp, out). The bias
    is replicated and added after the sum; under sequence parallelism each rank's bias gradient covers
    only its tokens, so its gradient is summed over tp (`copy_to_region` on the parameter). A Conv1D keeps its
    (in, out) layout: its rows are split.
    """

    def __init__(self, linear: nn.Module, axis: Axis, *, name: str = "", sequence_parallel: bool = False):
        super().__init__()
        self.axis, self.name, self.sequence_parallel = axis, name, sequence_parallel
        self.in_features, self.out_features, self.transposed = linear_features(linear)
        if self.in_features % axis.size:
            raise PlanError(f"'{name}' (rowwise) has in_features {self.in_features}, not divisible by the "
                            f"tensor-parallel size {axis.size}; choose a tensor_parallel.size that divides it")
        dim = 0 if self.transposed else 1  # the input dimension of the weight
        self.placements: dict[str, Shard] = {}
        _sharded_param(self, "weight", _shard(linear.weight.detach(), dim, axis, self.in_features),
                       linear.weight.requires_grad, Shard(dim, self.in_features))  # (out, in/tp)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=linear.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_width(x, self.in_features // self.axis.size, self.name, "rowwise", "its input must be split "
                     "over tp, i.e. come from colwise layers (mark the layers that feed it 'colwise')")
        y = linear(x, self.weight, transposed=self.transposed)  # (b, s, out): this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.axis, SEQ_DIM, ACTIVATION_TAG)  # (b, s/tp, out)
        else:
            y = reduce_from_region(y, self.axis, ACTIVATION_TAG)  # (b, s, out)
        if self.bias is not None:
            y = y + (copy_to_region(self.bias, self.axis, GRAD_TAG) if self.sequence_parallel else self.bias)
        return y

    def weight_grad_parameters(self) -> list[nn.Parameter]:
        """The weight whose gradient a split backward defers to W (`paratrain.weight_grad`)."""
        return [self.weight]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.in_features // self.axis.size}), "
                f"out_features={self.out_features}, tp={self.axis.size}, sequence_parallel={self.sequence_parallel}"
                + (", transposed" if self.transposed else ""))


class VocabParallelEmbedding(nn.Module):
    """An embedding table with its rows (the vocabulary) split: each rank looks up the ids in its range,
    contributes zeros for the others, and the partial results are summed over tp (all-reduce, or a
    reduce-scatter along the sequence when `scatter_sequence`). An uneven vocabulary is padded with zero
    rows at the end, which no valid id ever reaches."""

    def __init__(self, embedding: nn.Embedding, axis: Axis, *, name: str = "", scatter_sequence: bool = False):
        super().__init__()
        unsupported = [k for k in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(embedding, k)]
        if unsupported:
            raise PlanError(f"'{name}' (vocab): nn.Embedding options {unsupported} are not supported by the "
                            f"vocab-parallel embedding; disable them or leave the module out of the plan")
        self.axis, self.name, self.scatter_sequence = axis, name, scatter_sequence
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padded_num_embeddings = padded_size(self.num_embeddings, axis.size)
        self.local_num_embeddings = self.padded_num_embeddings // axis.size
        self.vocab_start = axis.rank * self.local_num_embeddings
        pad = embedding.padding_idx
        in_range = pad is not None and self.vocab_start <= pad < self.vocab_start + self.local_num_embeddings
        self.local_padding_idx = pad - self.vocab_start if in_range else None
        self.placements: dict[str, Shard] = {}
        _sharded_param(self, "weight", _shard(embedding.weight.detach(), 0, axis, self.padded_num_embeddings),
                       embedding.weight.requires_grad, Shard(0, self.num_embeddings))  # (V/tp, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.local_num_embeddings)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)  # (b, s, d)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # this rank's partial sum
        if self.scatter_sequence:
            return reduce_scatter_to_sequence(out, self.axis, SEQ_DIM, EMBED_TAG)  # (b, s/tp, d)
        return reduce_from_region(out, self.axis, EMBED_TAG)  # (b, s, d)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}, local {self.local_num_embeddings}), "
                f"{self.embedding_dim}, tp={self.axis.size}, scatter_sequence={self.scatter_sequence}")

"""ZeRO-3's frozen weights: sharded like the trainable ones, minus what they do not need (FSDP2's way).

A unit's frozen parameters (a LoRA base, a frozen embedding) live in their own flat buffer per axis, cut into
equal shards exactly as the trainable ones (`FlatLayout`): each rank keeps its shard, in the compute dtype (no
fp32 master: nothing updates it), and the unit gathers it with the rest before it runs and frees it after. There
is no gradient, no reduce-scatter and no optimizer state. Without this, every rank would keep the whole frozen
base (a 70B LoRA run: ~140 GB of bf16 weights on every rank), the opposite of why people pick ZeRO-3.

Checkpoints read and write the shard through `FrozenShard.segments()` (the same ranges `master_segments` gives
for trainable shards, without optimizer state), so a frozen base saves, reshards and loads like any weight.

A 4-bit weight (QLoRA, adapters/quantized.py) is sharded as it is: its packed bytes in a uint8 buffer of their own
(never cast to the compute dtype), and the quantization-state tensors bitsandbytes' state dict holds as themselves
(`held_state`: each block's scale `<weight>.absmax`, the code book `<weight>.quant_map`, with double quantization the
scales' scales `<weight>.nested_absmax`) in a buffer per dtype under those names, all gathered and freed with the
unit, so bitsandbytes dequantizes the very bytes one process holds. Checkpoints store their shards like any frozen
tensor's (the walk over the state dict finds them covered). The rest stays whole on every rank: with double
quantization the scales' code book (1 KiB per layer; the state dict stores a copy of it, which a freed tensor
cannot give) and the offset (4 bytes, stored as a number).
"""

from __future__ import annotations

import torch
from torch import nn

import paratrain.comm as comm
from paratrain.adapters.quantized import held_state, is_4bit_weight, quantization_state
from paratrain.adapters.torchao_nf4 import SHARDED_PARTS, is_nf4_weight, mark_packed, nf4_parts, state_key
from paratrain.layout.mesh import Axis
from paratrain.parallel.dp.base import MasterSegment
from paratrain.parallel.dp.flat import FlatLayout, OffloadPolicy, ShardedBuffer, set_data


class FrozenShard(ShardedBuffer):
    """One unit's frozen parameters over one axis: this rank's shard and the full buffer gathered on demand."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], axis: Axis, dtype: torch.dtype, offload: OffloadPolicy):
        self.axis = axis
        self.layout = FlatLayout(named, axis.size, axis.rank)
        self.dtype = dtype
        home = offload.host if offload.offload_param else offload.device  # offload_param: the shard waits on the host
        if any(p.is_meta for _, p in named):  # deferred init: only the shard exists, filled in later
            self.shard = torch.zeros(self.layout.shard_numel, dtype=dtype, device=home)
        else:
            flat = self.layout.flatten([p.detach() for _, p in named], dtype, offload.device)
            self.shard = self.layout.shard_of(flat).to(home, copy=True)
            del flat
        self.full = torch.empty(self.layout.padded, dtype=dtype, device=offload.device)
        self.whole: list[torch.Tensor] = []  # kept whole beside the shard (a 4-bit weight's quantization state)
        for slot, view in zip(self.layout.slots, self.layout.views(self.full)):
            set_data(slot.param, view)
        self.free()

    def gather(self) -> comm.Handle:
        shard = self.shard
        return self.gather_from(shard if shard.device == self.full.device else shard.to(self.full.device))

    def segments(self) -> list[MasterSegment]:
        """The parameter ranges this rank's shard holds, for checkpoints and weights (as `master_segments`)."""
        return self.layout.master_segments()

    def gathered_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()

    def full_tensors(self) -> dict[int, torch.Tensor]:
        """{id(parameter): its whole value} (collective over the axis: the shard all-gathered into a new buffer)."""
        full = torch.empty(self.layout.padded, dtype=self.dtype, device=self.full.device)
        comm.all_gather_into(full, self.shard.to(full.device), self.axis, tag="state_dict")
        return self.layout.views_by_param(full)


def split_frozen(named: list[tuple[str, nn.Parameter]]) -> tuple[list, list]:
    """(trainable, frozen) of a unit's parameters, each in module order."""
    return [x for x in named if x[1].requires_grad], [x for x in named if not x[1].requires_grad]


def frozen_shards(frozen: list[tuple[str, nn.Parameter]], axis_of, dtype: torch.dtype,
                  offload: OffloadPolicy) -> list[FrozenShard]:
    """A unit's frozen parameters in shards: one buffer per axis and kind (the compute dtype, a 4-bit weight's
    packed bytes, its quantization state per dtype under the state-dict names `held_state` gives). A packed buffer's
    `whole` lists the rest of its weights' quantization state, kept whole."""
    by_kind: dict[tuple, tuple[Axis, torch.dtype, list]] = {}
    whole: dict[tuple, list[torch.Tensor]] = {}
    for name, param in frozen:
        if is_nf4_weight(param):  # torchao's NF4: its per-block tensors sharded, the mean and code book whole
            axis = axis_of(param)
            mark_packed(param.quantized_data, tuple(param.shape), whole=True)  # located as its matrix
            for part, tensor in nf4_parts(param):
                if part in SHARDED_PARTS:
                    key = ("nf4", id(axis), tensor.dtype)
                    named = name + state_key(part).removeprefix("weight")  # the packed bytes: the weight's name
                    by_kind.setdefault(key, (axis, tensor.dtype, []))[2].append((named, tensor))
                else:
                    whole.setdefault(("nf4", id(axis), torch.uint8), []).append(tensor)
            continue
        # packed bytes: bitsandbytes' 4-bit weight, or a tensor-parallel slice of torchao's NF4 (its scales whole)
        axis, packed = axis_of(param), is_4bit_weight(param) or getattr(param, "nf4_scales", None) is not None
        kind = param.dtype if packed else dtype  # packed data stays uint8
        by_kind.setdefault((id(axis), kind), (axis, kind, []))[2].append((name, param))
        if packed:
            held = held_state(param)
            for suffix, tensor in held:  # each under its state-dict name, in a buffer per dtype
                key = ("state", id(axis), tensor.dtype)
                by_kind.setdefault(key, (axis, tensor.dtype, []))[2].append((f"{name}.{suffix}", tensor))
            whole.setdefault((id(axis), kind), []).extend(
                t for t in quantization_state(param) if not any(t is h for _, h in held))
    shards = []
    for key, (axis, kind, named) in by_kind.items():
        shard = FrozenShard(named, axis, kind, offload)
        shard.whole = whole.get(key, [])
        shards.append(shard)
    return shards

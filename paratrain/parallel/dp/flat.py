"""Flat, padded parameter buffers cut into equal shards, one per data-parallel rank (the ZeRO layout).

A `FlatLayout` lays a list of parameters end to end in one 1-d buffer and pads it to a multiple of the
number of shards N, so every rank owns exactly `padded / N` elements: that equal split is what lets one
reduce-scatter hand each rank the reduced gradient of its slice and one all-gather rebuild the buffer.
The padding is at most N - 1 elements per buffer; it is zero in every gradient and never maps to a
parameter. The layout is also the metadata a checkpoint needs (`describe`): which parameter lives at which
offset of which buffer, and which slice this rank owns.

`MasterShard` is the fp32 slice of one buffer that this rank updates: the optimizer's parameter, its
gradient, and where both live (`OffloadPolicy`: the compute device, or host memory under offload).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import paratrain.comm as comm
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Placement
from paratrain.muon import MasterLayout, Piece
from paratrain.parallel.dp.base import MasterSegment, placement_spans


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in a flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


class FlatLayout:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]], shards: int, rank: int):
        self.slots: list[Slot] = []
        offset = 0
        for name, p in named_params:
            self.slots.append(Slot(name, p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.numel = offset
        self.shards = shards
        self.rank = rank
        self.shard_numel = -(-offset // shards)  # ceil
        self.padded = self.shard_numel * shards
        self.shard_start = rank * self.shard_numel

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new padded flat buffer holding `tensors` (one per slot) at their offsets; padding is zero."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for slot, t in zip(self.slots, tensors):
            flat[slot.offset:slot.offset + slot.numel].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like each slot's parameter."""
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]

    def views_by_param(self, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """{id(parameter): its view of `flat`} (what `state_with_gathered` takes)."""
        return {id(s.param): view for s, view in zip(self.slots, self.views(flat))}

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full (padded) buffer."""
        return flat[self.shard_start:self.shard_start + self.shard_numel]

    def shard_segments(self) -> list[tuple[Slot, int, int]]:
        """(slot, start, end): the part of each parameter inside this rank's shard, in shard coordinates."""
        out = []
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        for s in self.slots:
            start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
            if start < end:
                out.append((s, start - lo, end - lo))
        return out

    def master_segments(self) -> list[MasterSegment]:
        """The parameter ranges inside this rank's shard, for checkpoints (the shard is the master)."""
        return [MasterSegment(s.name, self.shard_start + lo - s.offset, self.shard_start + hi - s.offset, lo)
                for s, lo, hi in self.shard_segments()]

    def muon_layout(self, axis: Axis, placement_of: Callable[[torch.Tensor], Placement]) -> MasterLayout:
        """The buffer for Muon: its parameters (pieces) and, when it is cut into shards, the axis they are over."""
        pieces = tuple(Piece(s.offset, tuple(s.shape), placement_of(s.param)) for s in self.slots)
        return MasterLayout(pieces, self.padded, axis if self.shards > 1 else None)

    def describe(self) -> dict:
        """Checkpoint metadata: the parameters' offsets and this rank's slice."""
        return {"numel": self.numel, "padded": self.padded, "shards": self.shards, "rank": self.rank,
                "shard_start": self.shard_start, "shard_numel": self.shard_numel,
                "params": [{"name": s.name, "offset": s.offset, "numel": s.numel, "shape": list(s.shape)}
                           for s in self.slots]}


@dataclass(frozen=True)
class OffloadPolicy:
    """Where model states live: `device` computes; `host` holds what is offloaded."""

    device: torch.device
    offload_optimizer: bool = False
    offload_param: bool = False
    pin_memory: bool = False

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    @property
    def optimizer_device(self) -> torch.device:
        return self.host if self.offload_optimizer else self.device

    def to_optimizer(self, t: torch.Tensor) -> torch.Tensor:
        """A new fp32 copy of `t` where the optimizer runs (its own storage even when host == device)."""
        out = t.detach().to(self.optimizer_device, torch.float32, copy=True)
        # Pinned host memory makes the per-step copies asynchronous on CUDA; on a CPU-only machine there
        # is nothing to pin for, so the flag is ignored there.
        if self.offload_optimizer and self.pin_memory and torch.cuda.is_available():
            out = out.pin_memory()
        return out


class MasterShard:
    """The fp32 slice of one flat buffer this rank updates, with its gradient.

    `alias` (a slice of the model's own fp32 buffer) makes the master share storage with the model: then
    the optimizer updates the model in place and no copy exists. Otherwise the master is a separate fp32
    copy (mixed precision, offload, or stage 3 where the model's buffer is freed between uses).
    """

    def __init__(self, layout: FlatLayout, fp32_shard: torch.Tensor, offload: OffloadPolicy,
                 alias: torch.Tensor | None = None, owned: bool = False):
        self.layout = layout
        self.aliased = alias is not None
        self._spans: list[tuple[int, int, Placement]] | None = None
        if alias is not None:
            master = alias
        else:  # owned: `fp32_shard` is already a fresh fp32 tensor where the optimizer runs; no copy
            master = fp32_shard if owned else offload.to_optimizer(fp32_shard)
        self.param = nn.Parameter(master)

    @property
    def grad(self) -> torch.Tensor | None:
        return self.param.grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        self.param.grad = value

    def ensure_grad(self) -> torch.Tensor:
        """The fp32 gradient, allocated (zeros) the first time a reduction or the update needs it.

        Stages 2-3 keep this shard from the first backward on; allocating it there rather than at init keeps
        4Ψ/N bytes out of the init peak (FSDP2 makes its gradients at the first backward too), and a step
        without any backward still finds zeros, as it did when the shard was made at init."""
        if self.param.grad is None:
            self.param.grad = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self.param.device)
        return self.param.grad

    def accumulate(self, reduced: torch.Tensor, first: bool) -> None:
        """Add a reduced gradient slice (any dtype/device) into the fp32 gradient."""
        if reduced is self.param.grad:
            return
        if first:
            self.param.grad.copy_(reduced)
        else:
            self.param.grad.add_(reduced.to(self.param.grad.device, torch.float32))

    def grad_pieces(self, placement_of: Callable[[torch.Tensor], Placement]) -> list[tuple[torch.Tensor, Placement]]:
        """This shard's gradient in pieces of one parameter placement each (one piece when all agree);
        `placement_of` reads a parameter's records (the strategy's `Placements.of`)."""
        grad = self.param.grad
        if grad is None:
            return []
        if self._spans is None:  # the layout never changes: merge once
            segments = self.layout.shard_segments()
            spans = placement_spans([(lo, hi, placement_of(slot.param)) for slot, lo, hi in segments])
            # One placement: the whole shard, padding (zero) included, in one reduction.
            self._spans = ([(0, grad.numel(), spans[0][2])] if spans else []) if len(spans) <= 1 else spans
        return [(grad[lo:hi], placement) for lo, hi, placement in self._spans]


def split_param_groups(named_params: list[tuple[str, nn.Parameter]],
                       param_groups: list[dict] | None) -> list[tuple[dict, list[tuple[str, nn.Parameter]]]]:
    """Map the engine's param groups (dicts of model parameters) to (options, named params) per group."""
    if not named_params:
        return []
    if not param_groups:
        return [({}, list(named_params))]
    group_of: dict[int, int] = {}
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            if id(p) in group_of:
                raise InvalidValueError("a parameter appears in two param groups; each must be in exactly one")
            group_of[id(p)] = gi
    missing = [n for n, p in named_params if id(p) not in group_of]
    if missing:
        raise InvalidValueError(f"trainable parameter(s) missing from the param groups: {', '.join(missing[:8])}; "
                                f"put every parameter with requires_grad in a group (or freeze it)")
    out = []
    for gi, group in enumerate(param_groups):
        options = {k: v for k, v in group.items() if k != "params"}
        out.append((options, [(n, p) for n, p in named_params if group_of[id(p)] == gi]))
    return [g for g in out if g[1]]


def restrict_param_groups(param_groups: list | None, named: list) -> list | None:
    """The param groups, each restricted to the parameters in `named` (empty groups dropped later)."""
    if not param_groups:
        return None
    mine = {id(p) for _, p in named}
    return [{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in param_groups]


def group_index(param_groups: list | None, part: list, fallback: int) -> int:
    """Index of the engine param group that `part` (a non-empty list of named params) belongs to."""
    if not param_groups:
        return 0
    first = id(part[0][1])
    for gi, g in enumerate(param_groups):
        if any(id(p) == first for p in g["params"]):
            return gi
    return fallback


def optimizer_groups(groups: list[tuple[dict, list[MasterShard]]]) -> list:
    """The optimizer's param list: the masters, as one plain list or one dict per group with options."""
    if len(groups) == 1 and not groups[0][0]:
        return [m.param for m in groups[0][1]]
    return [{**options, "params": [m.param for m in masters]} for options, masters in groups]


def cast_untracked(module: nn.Module, dtype: torch.dtype, tracked: set) -> None:
    """Cast floating buffers and frozen parameters to the compute dtype (DeepSpeed's module.half())."""
    if dtype == torch.float32:
        return
    for t in list(module.buffers()) + [p for p in module.parameters() if p not in tracked]:
        if t.is_floating_point():
            t.data = t.data.to(dtype)


def state_with_gathered(module: nn.Module, gathered: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """module.state_dict() with sharded parameters replaced by their gathered fp32 values (copies)."""
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        out[name] = gathered[id(t)].detach().clone() if id(t) in gathered else t.detach().clone()
    return out


def gather_master(layout: FlatLayout, master: MasterShard, axis: Axis, device: torch.device) -> torch.Tensor:
    """Every rank's fp32 master slice of one flat buffer, all-gathered into a new padded fp32 buffer."""
    full = torch.empty(layout.padded, dtype=torch.float32, device=device)
    comm.all_gather_into(full, master.param.detach().to(device), axis, tag="state_dict")
    return full


def set_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """`param.data = data`, also for a parameter still on the meta device (a tensor of another type, which
    `.data` refuses): its object, hooks and records (placements) stay, so every reference to it still holds."""
    if param.is_meta and not data.is_meta:
        # First a real tensor of its own (own version counter), then `.data` as for any parameter: a parameter
        # made from `data` itself would share the version counter of `data`'s base, and the writes ZeRO-3 makes
        # into a unit's flat buffer would then look like in-place changes to autograd.
        hooks = dict(param._backward_hooks or {}), dict(param._post_accumulate_grad_hooks or {})
        new = nn.Parameter(torch.empty(0, dtype=param.dtype, device=data.device), requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)
        torch.utils.swap_tensors(param, new)
        # The swap leaves the hooks' dicts on the object but not on the autograd node behind it: register them
        # again (tensor parallelism's gradient sums under sequence parallelism are such hooks).
        param._backward_hooks = param._post_accumulate_grad_hooks = None
        for hook in hooks[0].values():
            param.register_hook(hook)
        for hook in hooks[1].values():
            param.register_post_accumulate_grad_hook(hook)
    param.data = data


def allocate_local(module: nn.Module, device: torch.device, parameters: bool) -> None:
    """Deferred init: give every meta buffer of `module` (and, with `parameters`, every parameter, frozen or not:
    ZeRO-3 allocates its own shards) uninitialized storage of its local size on `device`; values come later."""
    for sub in module.modules():
        for key, b in sub._buffers.items():
            if b is not None and b.is_meta:
                sub._buffers[key] = torch.empty_like(b, device=device)
        for p in sub._parameters.values():
            if p is not None and p.is_meta and parameters:
                set_data(p, torch.empty_like(p, device=device))


class ShardedBuffer:
    """A flat buffer of a unit's parameters over `axis`: the parameters are views of `full`, whose storage exists
    only while the unit is gathered (freed to zero bytes in between); one all-gather of the shards fills it."""

    full: torch.Tensor
    layout: FlatLayout
    axis: Axis

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def gather_from(self, source: torch.Tensor) -> comm.Handle:
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.layout.padded * self.full.element_size())
        handle = comm.all_gather_into(self.full, source, self.axis, tag="param", async_op=True)
        handle.source = source  # keep a transient input (a cast, a host-to-device copy) alive until it is done
        return handle

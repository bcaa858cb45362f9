"""Stage-3 units: which modules own which parameters, and one unit's flat sharded storage.

A unit is a module whose parameters are gathered together just before it runs and freed after. By default
every child of an `nn.ModuleList` (a transformer's blocks) is a unit and the root module is the unit of
whatever is left; `wrap_module_classes` (class names) and `wrap_module_names` (glob patterns over module
names, e.g. "blocks.*", "head") choose other modules. Units may nest: a parameter belongs to the innermost
unit around it. Parameters of at most `stage3_param_persistence_threshold` elements go to one persistent
unit that stays gathered (DeepSpeed's persistence: gathering tiny tensors costs more latency than memory).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch
from torch import nn

import paratrain.comm as comm
from paratrain.layout.mesh import Axis
from paratrain.parallel.dp.base import optimizer_state_tensors, tensor_bytes
from paratrain.parallel.dp.flat import (
    FlatLayout,
    MasterShard,
    OffloadPolicy,
    ShardedBuffer,
    gather_master,
    group_index,
    restrict_param_groups,
    set_data,
    split_param_groups,
    state_with_gathered,
)
from paratrain.parallel.dp.frozen import FrozenShard, frozen_shards, split_frozen
from paratrain.parallel.dp.gradients import StagedGradient

WrapPolicy = Callable[[str, nn.Module], bool]


def default_wrap_policy(root: nn.Module) -> WrapPolicy:
    """Every child of an nn.ModuleList: the blocks of a transformer, whatever the list is called."""
    in_lists = {id(child) for m in root.modules() if isinstance(m, nn.ModuleList) for child in m}
    return lambda name, module: id(module) in in_lists


def config_wrap_policy(root: nn.Module, classes: list[str] | None, names: list[str] | None) -> WrapPolicy:
    if not classes and not names:
        return default_wrap_policy(root)
    classes, names = set(classes or ()), list(names or ())
    return lambda name, module: type(module).__name__ in classes or any(name_matches(name, p) for p in names)


def name_matches(name: str, pattern: str) -> bool:
    """Glob over dotted module names where `*` stands for one name component: "blocks.*" matches
    "blocks.3" but not "blocks.3.attn" (the module-path pattern syntax used throughout the config)."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, wanted))


def assign_params(root: nn.Module, policy: WrapPolicy, persistence_threshold: int):
    """{unit name: [(param name, param)]} with "" = root, plus the persistent parameters, in module order."""
    units = [name for name, m in root.named_modules() if name and policy(name, m)]
    owned: dict[str, list[tuple[str, nn.Parameter]]] = {"": [], **{u: [] for u in units}}
    persistent: list[tuple[str, nn.Parameter]] = []
    for pname, p in root.named_parameters():  # frozen ones too: sharded like the rest (dp/frozen.py)
        if p.numel() <= persistence_threshold:
            persistent.append((pname, p))
            continue
        owner = max((u for u in units if pname.startswith(u + ".")), key=len, default="")
        owned[owner].append((pname, p))
    return owned, persistent


class FlatParam(ShardedBuffer):
    """One unit's parameters of one param group: a flat buffer gathered on demand, and this rank's shard.

    The module's parameters are views of `full`; while the unit is sharded, `full`'s storage is resized to
    zero bytes (the views keep their shapes but own no memory) and gathering resizes it back and
    all-gathers into it. The version counter of the parameters is untouched by these writes (they go
    through `full`, a different tensor), so autograd accepts the regathered values in backward.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], axis: Axis, dtype: torch.dtype, offload: OffloadPolicy):
        self.axis = axis  # gathered and reduce-scattered over it (experts: the expert-data-parallel axis)
        self.layout = FlatLayout(named, axis.size, axis.rank)
        self.dtype = dtype
        self.offload = offload
        if any(p.is_meta for _, p in named):  # deferred init: only the shard exists, filled in later
            # Allocated where the optimizer runs and used as the master itself: a zeros shard copied into
            # the master would leave its freed pages in the heap (glibc keeps mid-sized frees), one more
            # shard of resident memory per unit at init.
            fp32 = None
            shard = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=offload.optimizer_device)
            self.master = MasterShard(self.layout, shard, offload, owned=True)
        else:
            fp32 = self.layout.flatten([p.detach() for _, p in named], torch.float32, offload.device)
            shard = self.layout.shard_of(fp32)
            self.master = MasterShard(self.layout, shard, offload)
        # The fp32 gradient shard is made by the first reduction (MasterShard.ensure_grad), not here.
        # offload_optimizer keeps the master on the host: a compute-dtype copy of the shard stays on the
        # device as the all-gather input, unless offload_param sends that to the host too.
        self.device_shard = None
        if offload.offload_optimizer and not offload.offload_param:
            self.device_shard = shard.to(offload.device, dtype, copy=True)
        del fp32  # the full fp32 copy of the unit, when there was one
        self.full = torch.empty(self.layout.padded, dtype=dtype, device=offload.device)
        for slot, view in zip(self.layout.slots, self.layout.views(self.full)):
            set_data(slot.param, view)
        self.free()
        self.grads = StagedGradient(self.layout, self.master, dtype, offload.device)  # until reduce-scattered

    def gather(self) -> comm.Handle:
        master = self.master.param.detach()
        if self.device_shard is not None:
            source = self.device_shard
        elif master.device == self.full.device and master.dtype == self.dtype:
            source = master
        else:
            source = master.to(self.full.device, self.dtype)  # cast, or copy from the host (offload_param)
        return self.gather_from(source)

    def grads_arrived(self) -> bool:
        """Every parameter of this buffer has its gradient of the running backward in `.grad`."""
        return all(slot.param.grad is not None for slot in self.layout.slots)

    def stage_grads(self, accumulate: bool = False) -> list[str]:
        """Move the parameters' `.grad` into the staging buffer (one copy; `accumulate` adds) and drop them;
        the names of those without a gradient (staged as zero)."""
        grads = [slot.param.grad for slot in self.layout.slots]
        missing = [slot.name for slot, g in zip(self.layout.slots, grads) if g is None]
        self.grads.add_all(grads, accumulate)
        for slot in self.layout.slots:
            slot.param.grad = None
        return missing

    def reduce(self, first: bool, pre_divide: float = 1.0) -> comm.Handle:
        """Reduce-scatter this backward's gradients (missing ones count as zero) toward the fp32 shard."""
        return self.grads.reduce(self.axis, first, pre_divide)

    def collect(self) -> None:
        self.grads.collect()

    def refresh_device_shard(self) -> None:
        if self.device_shard is not None:
            self.device_shard.copy_(self.master.param.detach())


class Unit:
    """A module whose parameters are gathered and freed together (one FlatParam per param group)."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatParam], reshard_after_forward: bool,
                 keep: bool = False, frozen: list[FrozenShard] | None = None):
        self.name = name or "<root>"
        self.module = module
        self.flats = flats  # trainable: gathered, reduce-scattered, updated
        self.frozen = frozen or []  # frozen: only gathered
        # [Note: when a unit's backward is over] Every weight of a unit of trainable parameters is read by the
        # node that computes its own gradient, so the unit may be freed once every gradient has arrived
        # (`params_done`). A frozen weight has no gradient to announce it: the node that carries the gradient
        # through it to the unit's input may still be waiting then. A unit with frozen weights whose inputs
        # need a gradient is freed once both have happened (`inputs_done`: a hook on the forward's inputs).
        self.expects_inputs = False
        self.params_done = self.inputs_done = False
        self.staged = False  # this backward's gradients are in the staging buffers (`stage_grads`)
        self.reshard_after_forward = reshard_after_forward
        self.keep = keep  # persistent: never freed, regathered once after each optimizer step
        self.handles: list[comm.Handle] = []
        self.gathered = False  # the full parameters are present and current
        self.reduce_handles: list[comm.Handle] = []
        self.reduce_launched = False

    @property
    def backward_over(self) -> bool:
        """Both signs of the note have come (a unit without trainable parameters needs only its inputs')."""
        return (self.params_done or not self.flats) and (self.inputs_done or not self.expects_inputs)

    def gather(self) -> None:
        """Start the all-gather (no-op if gathered or already in flight)."""
        if not self.gathered and not self.handles:
            self.handles = [f.gather() for f in [*self.flats, *self.frozen]]

    def wait(self) -> None:
        self.gather()
        for h in self.handles:
            h.wait()
        self.handles = []
        self.gathered = True

    def reshard(self) -> None:
        if self.keep:
            return
        for h in self.handles:
            h.wait()
        self.handles = []
        for f in [*self.flats, *self.frozen]:
            f.free()
        self.gathered = False
        self.params_done = self.inputs_done = False

    def allocated_bytes(self) -> int:
        return sum(f.full.untyped_storage().nbytes() for f in [*self.flats, *self.frozen])


def build_units(root: nn.Module, policy: WrapPolicy, persistence_threshold: int, param_groups: list | None,
                axis_of: Callable[[nn.Parameter], Axis], dtype: torch.dtype, offload: OffloadPolicy,
                reshard_after_forward: bool):
    """The root unit, the other units (module order), the persistent unit (or None), and the optimizer's
    groups: (options, masters) per engine param group, in the engine's group order. A unit has one flat
    buffer per param group and reduction axis (`axis_of`: experts are sharded over their own axis)."""
    owned, persistent = assign_params(root, policy, persistence_threshold)
    modules = dict(root.named_modules())
    by_group: dict[int, tuple[dict, list[MasterShard]]] = {}

    def make_unit(name: str, named: list, keep: bool = False) -> Unit:
        named, frozen = split_frozen(named)
        flats = []
        for gi, (options, part) in enumerate(split_param_groups(named, restrict_param_groups(param_groups, named))):
            by_axis: dict[int, tuple[Axis, list]] = {}
            for name_param in part:
                axis = axis_of(name_param[1])
                by_axis.setdefault(id(axis), (axis, []))[1].append(name_param)
            for axis, same in by_axis.values():
                flat = FlatParam(same, axis, dtype, offload)
                flats.append(flat)
                by_group.setdefault(group_index(param_groups, part, gi), (options, []))[1].append(flat.master)
        shards = frozen_shards(frozen, axis_of, dtype, offload)
        return Unit(name, modules[name], flats, reshard_after_forward and bool(name), keep, shards)

    root_unit = make_unit("", owned[""])
    units = [make_unit(name, named) for name, named in owned.items() if name and named]
    persistent_unit = make_unit("", persistent, keep=True) if persistent else None
    if persistent_unit is not None:
        persistent_unit.name = "<persistent>"
    return root_unit, units, persistent_unit, [by_group[k] for k in sorted(by_group)]


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (where a recompute happens)."""
    return torch._C._current_graph_task_id() != -1


def units_memory_stats(flats: list[FlatParam], frozen: list[FrozenShard], optimizer, reduce_at_boundary: bool,
                       offload: OffloadPolicy) -> dict[str, int]:
    """ZeRO-3's model-state bytes on this rank: fp32 master shards (and their device copies), frozen shards, the
    units gathered right now, sharded gradients (unsharded through the window with reduce_at_boundary),
    optimizer state."""
    masters = [f.master.param for f in flats]
    master_grads = [f.master.grad for f in flats if f.master.grad is not None]  # none before the first backward
    states = optimizer_state_tensors(optimizer) if optimizer else []
    gathered = sum(f.full.untyped_storage().nbytes() for f in [*flats, *frozen])
    frozen_bytes = tensor_bytes([f.shard for f in frozen] + [t for f in frozen for t in f.whole])
    params = tensor_bytes(masters + [f.device_shard for f in flats if f.device_shard is not None]) + frozen_bytes \
        + gathered
    staged = [f.grads.staging for f in flats if f.grads.staging is not None] if reduce_at_boundary else []
    grads = tensor_bytes(master_grads + staged)
    optim = tensor_bytes(states)
    host = (tensor_bytes(masters + master_grads + states) if offload.offload_optimizer else 0) + \
        (frozen_bytes if offload.offload_param else 0)
    total = params + grads + optim
    return {"params": params, "grads": grads, "optimizer_state": optim, "total": total, "host": host,
            "device": total - host, "gathered_params": gathered, "frozen_params": frozen_bytes}


def units_full_state(module: nn.Module, flats: list[FlatParam], frozen: list[FrozenShard],
                     device: torch.device) -> dict[str, torch.Tensor]:
    """The module's full state dict on every rank: each flat's fp32 master and each frozen shard gathered
    (collective)."""
    gathered: dict[int, torch.Tensor] = {}
    for flat in flats:
        gathered.update(flat.layout.views_by_param(gather_master(flat.layout, flat.master, flat.axis, device)))
    for shard in frozen:
        gathered.update(shard.full_tensors())
    return state_with_gathered(module, gathered)

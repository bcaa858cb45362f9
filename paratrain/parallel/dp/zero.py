"""ZeRO stages 1 and 2 over flat, padded, sharded buckets.

Parameters are grouped (per optimizer param group, in reverse registration order, up to `reduce_bucket_size`
elements) into buckets; each bucket is one `FlatLayout` padded to a multiple of N = dp size, so rank r owns
elements [r*S, (r+1)*S) of every bucket. The model's parameters become views of the bucket's flat parameter
buffer, which every rank keeps in full. `ZeroDataParallel` holds what the stages share: the parameter buckets,
this rank's fp32 master slice of each (`MasterShard`), the publish step (after the update each rank writes its
master slice into its part of the bucket and one all-gather per bucket, in place, gives every rank the full
updated parameters), the checkpoint hooks, memory statistics and the gathered state dict. The stages differ
in how gradients are reduced and kept (the reducer's operation, `gradients.py`):

- `ZeroStage1`: the model's `.grad` are views of a full gradient bucket (accumulation happens there, as in
  DDP); on the last micro-step of a window each completed bucket is reduce-scattered *in place* while
  backward continues, so this rank's slice of the bucket then holds its reduced gradient.
- `ZeroStage2`: no full gradient buffer persists: each fresh gradient is staged, every micro-step's buckets
  are reduce-scattered and the reduced slice added into the fp32 gradient shard.

[Note: when the master is the model]
In fp32 without offload, the master slice *is* the rank's slice of the bucket (a view) and at stage 1 its
gradient *is* the slice of the gradient bucket: the optimizer updates the model in place and no copy exists,
which is how the memory reaches 8Ψ + 8Ψ/N (stage 1) and 4Ψ + 12Ψ/N (stage 2).
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from paratrain.errors import RunError
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Placement, Placements
from paratrain.muon import MasterLayout
from paratrain.parallel.dp.base import (
    GradSync,
    MasterSegment,
    OptimizerFactory,
    on_device_of,
    optimizer_state_tensors,
    tensor_bytes,
)
from paratrain.parallel.dp.flat import (
    FlatLayout,
    MasterShard,
    OffloadPolicy,
    cast_untracked,
    gather_master,
    optimizer_groups,
    split_param_groups,
    state_with_gathered,
)
from paratrain.parallel.dp.gradients import ReduceScatterInPlace, StagedReduceScatter
from paratrain.parallel.dp.param_gather import ParamGather
from paratrain.parallel.dp.reducer import BucketOperation, BucketReducer, GradBucket, NamedParams, plan_buckets
from paratrain.precision import compute_dtype


class ZeroDataParallel(GradSync):
    """What ZeRO-1 and ZeRO-2 share; a subclass says how gradients are reduced and kept."""

    def __init__(self, module: nn.Module, axis: Axis, precision: str = "fp32", bucket_numel: int = 500_000_000,
                 offload: OffloadPolicy | None = None, allow_unused_parameters: bool = False,
                 predivide_factor: float = 1.0, overlap_param_gather: bool = True, sync_initial_state: bool = True,
                 expert_axis: Axis | None = None, placements: Placements | None = None, replicate: Axis | None = None):
        super().__init__(module, axis, expert_axis, placements, replicate)
        self.overlap_param_gather = overlap_param_gather
        self.dtype = compute_dtype(precision)
        self.bucket_numel = bucket_numel
        self.offload = offload or OffloadPolicy(torch.device("cpu"))
        self.allow_unused = allow_unused_parameters
        self.pre_divide = predivide_factor
        self.post_divide = self.average_size / predivide_factor
        if sync_initial_state:  # False: the values are filled in later, identically on every rank (deferred init)
            self.broadcast_state()
        self.buckets: list[GradBucket] = []
        self.params_full: list[torch.Tensor] = []  # (padded,) compute dtype: the model's parameters are views
        self.masters: list[MasterShard] = []

    # ---- layout (needs the param groups, so it is built with the optimizer) ----------------------
    def build_optimizer(self, factory: OptimizerFactory, param_groups: list | None = None) -> torch.optim.Optimizer:
        groups = []
        for options, named in split_param_groups(self.named_params, param_groups):
            first = len(self.buckets)
            for chunk in plan_buckets(list(reversed(named)), self.bucket_numel, lambda p: p.numel(), self.axis_of):
                self._add_bucket(chunk)
            groups.append((options, self.masters[first:]))
        cast_untracked(self.module, self.dtype, {p for _, p in self.named_params})
        self.operation = self._gradient_operation()
        self.reducer = BucketReducer(self.buckets, self.operation, self.allow_unused)
        self.gather = ParamGather(self.module, self.buckets, self.params_full, self.axis, self.overlap_param_gather)
        self.optimizer = factory(optimizer_groups(groups))
        return self.optimizer

    def _add_bucket(self, named: NamedParams) -> None:
        device = self.offload.device
        axis = self.axis_of(named[0][1])
        layout = FlatLayout(named, axis.size, axis.rank)
        fp32 = layout.flatten([p.detach() for _, p in named], torch.float32, device)
        params_full = fp32 if self.dtype == torch.float32 else fp32.to(self.dtype)
        alias = self.dtype == torch.float32 and not self.offload.offload_optimizer
        master = MasterShard(layout, layout.shard_of(fp32), self.offload,
                             alias=layout.shard_of(params_full) if alias else None)
        for slot, view in zip(layout.slots, layout.views(params_full)):
            slot.param.data = view
        self.buckets.append(GradBucket(len(self.buckets), layout, self.dtype, device, axis))
        self.params_full.append(params_full)
        self.masters.append(master)

    @abstractmethod
    def _gradient_operation(self) -> BucketOperation:
        """The reducer's per-bucket operation (called once the buckets and masters exist)."""

    # ---- backward ---------------------------------------------------------------------------------
    def no_sync(self):
        return self.reducer.no_sync()

    def prepare_backward(self, sync: bool) -> None:
        self.reducer.begin_backward(sync)

    # ---- update -----------------------------------------------------------------------------------
    def local_gradients(self) -> list[torch.Tensor]:
        return [master.ensure_grad() for master in self.masters]

    def grad_pieces(self) -> list[tuple[torch.Tensor, Placement]]:
        return [piece for master in self.masters for piece in master.grad_pieces(self.held_placement)]

    @property
    def shards_gradients(self) -> bool:
        return self.axis.size > 1

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        factor = on_device_of(factor, [master.grad for master in self.masters])  # offloaded: a host copy
        for master in self.masters:
            master.grad.mul_(factor)

    def optimizer_step(self) -> None:
        self.wait_for_params()  # a bucket no forward read since the last update may still be gathering
        self.optimizer.step()
        self._publish_masters()

    def _publish_masters(self) -> None:
        """Write each master slice into its part of the bucket; all-gather so every rank has every slice
        (behind the next forward with overlap_param_gather, `param_gather.py`)."""
        self.wait_for_params()
        with torch.no_grad():
            for bucket, params_full, master in zip(self.buckets, self.params_full, self.masters):
                if not master.aliased:  # cast to the compute dtype / copy from host
                    bucket.layout.shard_of(params_full).copy_(master.param)
        self.gather.launch()

    def wait_for_params(self) -> None:
        self.gather.wait()

    # ---- checkpoint hooks ---------------------------------------------------------------------------
    def master_segments(self) -> list[tuple[torch.Tensor, list[MasterSegment]]]:
        self.wait_for_params()  # a checkpoint reads and writes the masters: none may be in a gather
        return [(m.param, b.layout.master_segments()) for b, m in zip(self.buckets, self.masters)]

    def muon_layouts(self) -> list[tuple[torch.Tensor, MasterLayout]]:
        return [(m.param, b.layout.muon_layout(b.axis, self.placements.of)) for b, m in zip(self.buckets, self.masters)]

    @property
    def masters_replicated(self) -> bool:
        return all(b.axis.size == 1 for b in self.buckets) if self.buckets else self.axis.size == 1

    def masters_loaded(self) -> None:
        self.zero_grad()
        self._publish_masters()

    # ---- introspection ----------------------------------------------------------------------------
    def padded_numel(self) -> int:
        """Ψ rounded up per bucket to a multiple of N: the elements every collective moves."""
        return sum(b.layout.padded for b in self.buckets)

    def memory_stats(self) -> dict[str, int]:
        self.wait_for_params()
        masters = [m.param for m in self.masters]
        master_grads = [m.grad for m in self.masters if m.grad is not None]
        states = optimizer_state_tensors(self.optimizer) if self.optimizer else []
        frozen = self.frozen_param_bytes()
        params = tensor_bytes(self.params_full + masters) + frozen
        grads = tensor_bytes(self.operation.tensors() + master_grads)
        optim = tensor_bytes(states)
        host = tensor_bytes(masters + master_grads + states) if self.offload.offload_optimizer else 0
        total = params + grads + optim
        return {"params": params, "grads": grads, "optimizer_state": optim, "total": total, "host": host,
                "device": total - host, "frozen_params": frozen}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self.wait_for_params()
        gathered: dict[int, torch.Tensor] = {}
        for bucket, params_full, master in zip(self.buckets, self.params_full, self.masters):
            layout = bucket.layout
            # aliased: the bucket already holds the gathered fp32 masters
            full = params_full if master.aliased else gather_master(layout, master, bucket.axis, self.offload.device)
            gathered.update(layout.views_by_param(full))
        return state_with_gathered(self.module, gathered)


class ZeroStage1(ZeroDataParallel):
    """Optimizer state sharded; full gradient buckets, reduce-scattered in place at the window's end."""

    def __init__(self, *args, free_grad_buckets: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_grad_buckets = free_grad_buckets

    def _gradient_operation(self) -> ReduceScatterInPlace:
        operation = ReduceScatterInPlace(self.buckets, self.axis, self.pre_divide, self.free_grad_buckets)
        for bucket, master, buffer in zip(self.buckets, self.masters, operation.buffers):
            if master.aliased:  # fp32: the reduced slice of the gradient bucket is the master's gradient
                master.grad = bucket.layout.shard_of(buffer)
        return operation

    def finish_gradients(self) -> None:
        self.operation.allocate()  # freed buckets no gradient reached are read as zeros from here on
        if not self.reducer.finish():
            return
        self.sum_over_replicas([b.layout.shard_of(f) for b, f in zip(self.buckets, self.operation.buffers)],
                               self.offload.device)
        for bucket, master, buffer in zip(self.buckets, self.masters, self.operation.buffers):
            if master.grad is None:  # the fp32 gradient exists only from here to zero_grad
                mine = bucket.layout.shard_of(buffer)
                master.grad = mine.to(master.param.device, torch.float32, copy=True)

    def zero_grad(self) -> None:
        self.operation.zero()
        for master in self.masters:
            if not master.aliased:
                master.grad = None


class ZeroStage2(ZeroDataParallel):
    """Optimizer state and gradients sharded: every backward's gradients reduce-scattered into fp32 shards (or,
    with `reduce_at_boundary`, accumulated unsharded over the window and reduce-scattered once at its end)."""

    def __init__(self, *args, reduce_at_boundary: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.reduce_at_boundary = reduce_at_boundary

    def _gradient_operation(self) -> StagedReduceScatter:
        # The fp32 gradient shards are made by the first reduction (MasterShard.ensure_grad), not at init.
        return StagedReduceScatter(self.buckets, self.masters, self.axis, self.pre_divide,
                                   accumulate=self.reduce_at_boundary)

    def no_sync(self):
        raise RunError("no_sync() needs a full gradient buffer to accumulate into, which ZeRO stage 2 "
                       "does not keep; use gradient_accumulation_steps, or zero_optimization.stage 1")

    def finish_gradients(self) -> None:
        self.reducer.finish()  # the last backward's reductions, if not collected yet
        self.sum_over_replicas([master.ensure_grad() for master in self.masters], self.offload.device)

    def zero_grad(self) -> None:
        self.operation.new_window()  # the first reduction of the next window overwrites the shard


ZERO_STAGES: dict[int, type[ZeroDataParallel]] = {1: ZeroStage1, 2: ZeroStage2}

"""Distributed data parallel (ZeRO stage 0) in every precision: full replicas, gradients all-reduced in buckets.

Gradients go through the shared reducer (`reducer.py`) with `AllReduce` buckets of up to
`data_parallel.bucket_cap_mb` (reverse registration order, split where the dtype changes): every `.grad` is a
view of its bucket, a bucket's all-reduce starts as soon as all its gradients of the window's last micro-step
have landed, and the engine waits once, before the optimizer step. Other micro-steps communicate nothing.

[Note: one optimizer tensor per parameter]
What the optimizer updates is one tensor per parameter in every precision, so per-tensor optimizers (LAMB,
LARS, ...) work under DDP, with the engine's param groups as given:
- fp32 (`ModelAsMaster`): the module's own parameters, whose gradients are the bucket views;
- bf16/fp16 (`MasterCopies`): fp32 copies. The module's parameters become compute-dtype views of one flat
  buffer per bucket and their masters fp32 views of another, so writing the update back is one copy per
  bucket; the masters' fp32 gradients exist from the reduction to the end of the step (not model state).
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Placement, Placements
from paratrain.parallel.dp.base import (
    GradSync,
    MasterSegment,
    OptimizerFactory,
    optimizer_state_tensors,
    placement_spans,
    tensor_bytes,
)
from paratrain.parallel.dp.flat import FlatLayout, cast_untracked, split_param_groups, state_with_gathered
from paratrain.parallel.dp.gradients import AllReduce
from paratrain.parallel.dp.reducer import BucketReducer, GradBucket, NamedParams, plan_buckets
from paratrain.precision import compute_dtype


class ModelAsMaster:
    """fp32: the optimizer updates the module's own parameters; the gradient buckets are their gradients."""

    def __init__(self, named_params: NamedParams):
        self.named_params = named_params

    def master(self, param: nn.Parameter) -> torch.Tensor:
        return param

    def optimizer_params(self, param_groups: list | None) -> list:
        return param_groups if param_groups is not None else [p for _, p in self.named_params]

    def take_gradients(self, buffers: list[torch.Tensor]) -> None:
        """Nothing to take: the buckets are the gradients."""

    def grad_flats(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        return buffers

    def drop_gradients(self) -> None:
        """Nothing to drop: the buckets are the gradients."""

    def publish(self) -> None:
        """Nothing to publish: the optimizer updated the model itself."""

    def tensors(self) -> list[torch.Tensor]:
        return [p for _, p in self.named_params]

    def grad_tensors(self) -> list[torch.Tensor]:
        return []

    def gathered(self) -> dict[int, torch.Tensor]:
        return {}


class MasterCopies:
    """bf16/fp16: an fp32 master per parameter (views of one flat fp32 buffer per bucket); the model's
    parameters become compute-dtype views of one flat buffer per bucket."""

    def __init__(self, buckets: list[GradBucket], named_params: NamedParams, dtype: torch.dtype):
        self.named_params = named_params
        self.layouts = [b.layout for b in buckets]
        self.param_flats: list[torch.Tensor] = []
        self.master_flats: list[torch.Tensor] = []
        self.masters: dict[nn.Parameter, nn.Parameter] = {}
        for bucket in buckets:
            layout = bucket.layout
            fp32 = layout.flatten([s.param.detach() for s in layout.slots], torch.float32, bucket.device)
            low = fp32.to(dtype)
            for slot, low_view, fp32_view in zip(layout.slots, layout.views(low), layout.views(fp32)):
                slot.param.data = low_view
                self.masters[slot.param] = nn.Parameter(fp32_view)
            self.param_flats.append(low)
            self.master_flats.append(fp32)
        self._grad_flats: list[torch.Tensor] = []

    def master(self, param: nn.Parameter) -> torch.Tensor:
        return self.masters[param]

    def optimizer_params(self, param_groups: list | None) -> list:
        groups = split_param_groups(self.named_params, param_groups)
        if len(groups) == 1 and not groups[0][0]:
            return [self.masters[p] for _, p in groups[0][1]]
        return [{**options, "params": [self.masters[p] for _, p in named]} for options, named in groups]

    def take_gradients(self, buffers: list[torch.Tensor]) -> None:
        self._grad_flats = []
        for layout, buffer in zip(self.layouts, buffers):
            flat = buffer.to(torch.float32, copy=True)
            for slot, view in zip(layout.slots, layout.views(flat)):
                self.masters[slot.param].grad = view
            self._grad_flats.append(flat)

    def grad_flats(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._grad_flats

    def drop_gradients(self) -> None:
        for master in self.masters.values():
            master.grad = None
        self._grad_flats = []

    def publish(self) -> None:
        with torch.no_grad():
            for low, fp32 in zip(self.param_flats, self.master_flats):
                low.copy_(fp32)

    def tensors(self) -> list[torch.Tensor]:
        return self.param_flats + self.master_flats

    def grad_tensors(self) -> list[torch.Tensor]:
        return list(self._grad_flats)

    def gathered(self) -> dict[int, torch.Tensor]:
        return {id(p): master for p, master in self.masters.items()}


class DistributedDataParallel(GradSync):
    def __init__(self, module: nn.Module, axis: Axis, precision: str = "fp32", bucket_cap_mb: float = 25.0,
                 allow_unused_parameters: bool = False, predivide_factor: float = 1.0,
                 broadcast_buffers: bool = True, free_grad_buckets: bool = False, sync_initial_state: bool = True,
                 expert_axis: Axis | None = None, placements: Placements | None = None):
        super().__init__(module, axis, expert_axis, placements)
        self.free_grad_buckets = free_grad_buckets
        self.dtype = compute_dtype(precision)
        self.mixed = precision != "fp32"
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.allow_unused = allow_unused_parameters
        self.pre_divide = predivide_factor
        self.post_divide = axis.size / predivide_factor
        if sync_initial_state:  # False: the values are filled in later, identically on every rank (deferred init)
            self.broadcast_state(buffers=broadcast_buffers)
        self.buckets: list[GradBucket] = []

    # ---- buckets (built with the optimizer, like every strategy's state) -------------------------
    def build_optimizer(self, factory: OptimizerFactory, param_groups: list | None = None) -> torch.optim.Optimizer:
        def size_of(p: nn.Parameter) -> int:  # bytes in the dtype its gradient will have
            return p.numel() * (self.dtype.itemsize if self.mixed else p.element_size())

        plans = plan_buckets(list(reversed(self.named_params)), self.bucket_cap_bytes, size_of, self.axis_of)
        self.buckets = [GradBucket(i, FlatLayout(named, 1, 0), self.dtype if self.mixed else named[0][1].dtype,
                                   named[0][1].device, self.axis_of(named[0][1])) for i, named in enumerate(plans)]
        if self.mixed:  # cast the model before its gradient buckets (of the compute dtype) are attached
            self.masters = MasterCopies(self.buckets, self.named_params, self.dtype)
            cast_untracked(self.module, self.dtype, {p for _, p in self.named_params})
        else:
            self.masters = ModelAsMaster(self.named_params)
        self.grads = AllReduce(self.buckets, self.axis, self.pre_divide, self.free_grad_buckets)
        self.reducer = BucketReducer(self.buckets, self.grads, self.allow_unused)
        # each bucket in pieces of one placement (for the norm)
        of = self.placements.of
        self.spans = [placement_spans([(s.offset, s.offset + s.numel, of(s.param)) for s in b.layout.slots])
                      for b in self.buckets]
        self.optimizer = factory(self.masters.optimizer_params(param_groups))
        return self.optimizer

    # ---- backward ---------------------------------------------------------------------------------
    def no_sync(self):
        return self.reducer.no_sync()

    def prepare_backward(self, sync: bool) -> None:
        self.reducer.begin_backward(sync)

    def finish_gradients(self) -> None:
        self.grads.allocate()  # freed buckets no gradient reached are read as zeros from here on
        if self.reducer.finish():
            self.masters.take_gradients(self.grads.buffers)

    # ---- update -----------------------------------------------------------------------------------
    def grad_pieces(self) -> list[tuple[torch.Tensor, Placement]]:
        flats = self.masters.grad_flats(self.grads.buffers)
        return [(flat[start:end], placement) for flat, spans in zip(flats, self.spans)
                for start, end, placement in spans]

    @property
    def shards_gradients(self) -> bool:
        return False

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        for flat in self.masters.grad_flats(self.grads.buffers):
            flat.mul_(factor)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.masters.publish()

    def zero_grad(self) -> None:
        self.grads.zero()
        self.masters.drop_gradients()

    # ---- checkpoint hooks: one master per parameter, identical on every rank -------------------------
    def master_segments(self) -> list[tuple[torch.Tensor, list[MasterSegment]]]:
        return [(self.masters.master(p), [MasterSegment(name, 0, p.numel(), 0)]) for name, p in self.named_params]

    @property
    def masters_replicated(self) -> bool:
        return True

    def masters_loaded(self) -> None:
        self.zero_grad()
        self.masters.publish()

    # ---- introspection ----------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        frozen = self.frozen_param_bytes()
        params = tensor_bytes(self.masters.tensors()) + frozen
        grads = tensor_bytes(self.grads.tensors() + self.masters.grad_tensors())
        optim = tensor_bytes(optimizer_state_tensors(self.optimizer)) if self.optimizer else 0
        total = params + grads + optim
        return {"params": params, "grads": grads, "optimizer_state": optim, "total": total, "host": 0,
                "device": total, "frozen_params": frozen}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return state_with_gathered(self.module, self.masters.gathered())

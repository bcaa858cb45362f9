"""ZeRO stages 1 and 2 (and mixed-precision stage 0) over flat, padded, bucketed buffers.

Parameters are grouped (per optimizer param group, in reverse registration order, up to
`reduce_bucket_size` elements) into buckets; each bucket is one `FlatLayout` padded to a multiple of N =
dp size, so rank r owns elements [r*S, (r+1)*S) of every bucket. The model's parameters become views of
the bucket's flat parameter buffer, which every rank keeps in full.

- Stage 0 (used for bf16/fp16 only; fp32 stage 0 is `ddp.py`): full gradient buckets, all-reduced; an
  fp32 master copy of every parameter. The "shard" is the whole bucket.
- Stage 1: the model's `.grad` are views of a full gradient bucket (accumulation happens there, as in DDP);
  on the last micro-step of a window each completed bucket is reduce-scattered *in place* while backward
  continues, so this rank's slice of the bucket then holds its reduced gradient. Optimizer state exists
  only for the slice.
- Stage 2: no full gradient buffer persists. A hook copies each parameter's fresh gradient into the
  bucket's transient staging buffer and drops `.grad`; a completed bucket is reduce-scattered at once
  (every micro-step: without a full gradient there is nothing to accumulate into) and the reduced slice is
  added into the fp32 gradient shard. Reductions are waited for at the next backward or at the step, so
  they overlap the following forward.

After the update each rank writes its master slice into its part of the bucket and one all-gather per
bucket (in place) gives every rank the full updated parameters.

[Note: when the master is the model]
In fp32 without offload, the master slice *is* the rank's slice of the bucket (a view) and at stage 1
its gradient *is* the slice of the gradient bucket: the optimizer updates the model in place and no copy
exists, which is how the memory reaches 8Ψ + 8Ψ/N (stage 1) and 4Ψ + 12Ψ/N (stage 2).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from paratrain import comm
from paratrain.data_parallel.base import (
    GradSync,
    MasterSegment,
    OptimizerFactory,
    optimizer_state_tensors,
    sum_over_model_parallel,
    tensor_bytes,
    weak_hook,
)
from paratrain.data_parallel.ddp import UnusedParametersError, broadcast_module_state
from paratrain.data_parallel.flat import (
    FlatLayout,
    MasterShard,
    Placement,
    cast_untracked,
    optimizer_groups,
    split_param_groups,
    state_with_gathered,
)
from paratrain.mesh import Mesh
from paratrain.precision import compute_dtype


class _Bucket:
    def __init__(self, index: int, layout: FlatLayout, params_full: torch.Tensor, master: MasterShard):
        self.index = index
        self.layout = layout
        self.params_full = params_full  # (padded,) compute dtype: the model's parameters are views of it
        self.master = master
        self.grads_full: torch.Tensor | None = None  # stages 0-1: the model's .grad are views of it
        self.grad_views: list[torch.Tensor] = []
        self.staging: torch.Tensor | None = None  # stage 2: this backward's gradients, until reduced
        self.reduced: torch.Tensor | None = None  # stage 2: the reduce-scatter output
        self.first = True  # stage 2: the reduction overwrites (first micro-step) or adds
        self.ready: set[int] = set()
        self.handle: comm.Handle | None = None


class ZeroDataParallel(GradSync):
    def __init__(self, module: nn.Module, mesh: Mesh, stage: int, precision: str = "fp32",
                 bucket_numel: int = 500_000_000, placement: Placement | None = None,
                 allow_unused_parameters: bool = False, predivide_factor: float = 1.0):
        super().__init__(module, mesh)
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroDataParallel runs stages 0-2, got {stage}; stage 3 is FullyShardedDataParallel")
        self.stage = stage
        self.dtype = compute_dtype(precision)
        self.bucket_numel = bucket_numel
        self.placement = placement or Placement(torch.device("cpu"))
        self.allow_unused = allow_unused_parameters
        self.pre_divide = predivide_factor
        self.post_divide = self.axis.size / predivide_factor
        self.shards = 1 if stage == 0 else self.axis.size
        broadcast_module_state(module, self.axis)
        self.buckets: list[_Bucket] = []
        self._slot: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        self._sync = False
        self._force_no_sync = False
        self._next_launch = 0
        self._backward_pending = False  # stage 2: a backward ran whose reductions are not yet collected
        self._first_in_window = True

    # ---- layout (needs the param groups, so it is built with the optimizer) ----------------------
    def build_optimizer(self, factory: OptimizerFactory, param_groups: list | None = None) -> torch.optim.Optimizer:
        groups = []
        for options, named in split_param_groups(self.named_params, param_groups):
            masters = []
            for chunk in _chunks(list(reversed(named)), self.bucket_numel):
                bucket = self._make_bucket(chunk)
                self.buckets.append(bucket)
                masters.append(bucket.master)
            groups.append((options, masters))
        cast_untracked(self.module, self.dtype, {p for _, p in self.named_params})
        self.optimizer = factory(optimizer_groups(groups))
        return self.optimizer

    def _make_bucket(self, named: list[tuple[str, nn.Parameter]]) -> _Bucket:
        device = self.placement.device
        layout = FlatLayout(named, self.shards, self.axis.rank if self.stage > 0 else 0)
        fp32 = layout.flatten([p.detach() for _, p in named], torch.float32, device)
        params_full = fp32 if self.dtype == torch.float32 else fp32.to(self.dtype)
        alias = self.dtype == torch.float32 and not self.placement.offload_optimizer and self.stage > 0
        master = MasterShard(layout, layout.shard_of(fp32), self.placement,
                             alias=layout.shard_of(params_full) if alias else None)
        bucket = _Bucket(len(self.buckets), layout, params_full, master)
        for i, (slot, view) in enumerate(zip(layout.slots, layout.views(params_full))):
            slot.param.data = view
            self._slot[slot.param] = (bucket, i)
            slot.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))
        if self.stage < 2:
            bucket.grads_full = torch.zeros(layout.padded, dtype=self.dtype, device=device)
            bucket.grad_views = layout.views(bucket.grads_full)
            for slot, view in zip(layout.slots, bucket.grad_views):
                slot.param.grad = view
            if alias:  # stage 1, fp32: the reduced slice of the gradient bucket is the master's gradient
                master.grad = layout.shard_of(bucket.grads_full)
        else:
            master.grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=master.param.device)
        return bucket

    # ---- backward ---------------------------------------------------------------------------------
    @contextmanager
    def no_sync(self):
        if self.stage == 2:
            raise RuntimeError("no_sync() needs a full gradient buffer to accumulate into, which ZeRO stage 2 "
                               "does not keep; use gradient_accumulation_steps, or zero_optimization.stage 1")
        previous, self._force_no_sync = self._force_no_sync, True
        try:
            yield
        finally:
            self._force_no_sync = previous

    def prepare_backward(self, sync: bool) -> None:
        if self.stage == 2 and self._backward_pending:
            self._collect()
        self._sync = sync and not self._force_no_sync
        self._backward_pending = True

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket, i = self._slot[param]
        if self.stage < 2:
            view = bucket.grad_views[i]
            if param.grad is not view:  # .grad was replaced (set_to_none): move it into the bucket
                view.copy_(param.grad)
                param.grad = view
            if not self._sync:
                return
        else:
            if bucket.staging is None:
                bucket.staging = torch.zeros(bucket.layout.padded, dtype=self.dtype, device=self.placement.device)
            slot = bucket.layout.slots[i]
            bucket.staging[slot.offset:slot.offset + slot.numel].copy_(param.grad.reshape(-1))
            param.grad = None
        bucket.ready.add(i)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.layout.slots):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        layout = bucket.layout
        if self.stage == 2:
            full = bucket.staging if bucket.staging is not None else \
                torch.zeros(layout.padded, dtype=self.dtype, device=self.placement.device)
            bucket.staging = full
            grad = bucket.master.grad
            direct = self._first_in_window and grad.dtype == self.dtype and grad.device == full.device
            bucket.reduced = grad if direct else torch.empty(layout.shard_numel, dtype=self.dtype, device=full.device)
            bucket.first = self._first_in_window
        else:
            full = bucket.grads_full
        if self.pre_divide != 1.0:
            full.div_(self.pre_divide)
        if self.stage == 0:
            bucket.handle = comm.all_reduce(full, self.axis, tag="grad", async_op=True)
        elif self.stage == 1:
            bucket.handle = comm.reduce_scatter_into(layout.shard_of(full), full, self.axis, tag="grad",
                                                     async_op=True)
        else:
            if bucket.index > 0:  # one reduction in flight: the previous bucket's staging buffer is freed now
                self._accumulate(self.buckets[bucket.index - 1])
            bucket.handle = comm.reduce_scatter_into(bucket.reduced, full, self.axis, tag="grad", async_op=True)

    def _flush(self, check_unused: bool) -> None:
        """Launch every bucket not launched yet (in order); missing gradients count as zero."""
        missing = [s.name for b in self.buckets[self._next_launch:] for i, s in enumerate(b.layout.slots)
                   if i not in b.ready]
        if missing and check_unused and not self.allow_unused:
            raise UnusedParametersError.naming(missing)
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        self._next_launch = 0

    def _accumulate(self, bucket: _Bucket) -> None:
        """Stage 2: wait for a bucket's reduce-scatter, add it into the shard, free the staging buffer."""
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.master.accumulate(bucket.reduced, bucket.first)
            bucket.handle = bucket.staging = bucket.reduced = None

    def _collect(self) -> None:
        """Stage 2: finish this backward's reductions and add them into the gradient shards."""
        self._flush(check_unused=True)
        for bucket in self.buckets:
            self._accumulate(bucket)
            bucket.ready.clear()
        self._first_in_window = False
        self._backward_pending = False

    def finish_gradients(self) -> None:
        if self.stage == 2:
            if self._backward_pending:
                self._collect()
            for bucket in self.buckets:
                bucket.master.grad.div_(self.post_divide)
            return
        if not self._sync:
            return
        self._flush(check_unused=True)
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle = None
            bucket.ready.clear()
            mine = bucket.layout.shard_of(bucket.grads_full)
            if bucket.master.grad is None:  # the fp32 gradient exists only from here to zero_grad
                bucket.master.grad = mine.to(bucket.master.param.device, torch.float32, copy=True)
            bucket.master.grad.div_(self.post_divide)
        self._sync = False
        self._backward_pending = False

    # ---- update -----------------------------------------------------------------------------------
    def local_grad_sq(self) -> torch.Tensor:
        # On the compute device: the norm is all-reduced there (NCCL reduces no host tensors).
        total = torch.zeros((), dtype=torch.float32, device=self.placement.device)
        for bucket in self.buckets:
            total += bucket.master.grad_sq(self.mesh, self.placement.device)
        return total

    def global_grad_norm(self) -> float:
        local = self.local_grad_sq()
        if self.stage > 0:  # every rank holds a different slice
            comm.all_reduce(local, self.axis, tag="grad_norm")
        return math.sqrt(float(sum_over_model_parallel(local, self.mesh)))

    def scale_gradients(self, factor: float) -> None:
        for bucket in self.buckets:
            bucket.master.grad.mul_(factor)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self._publish_masters()

    def _publish_masters(self) -> None:
        """Write each master slice into its part of the bucket; all-gather so every rank has every slice."""
        handles = []
        with torch.no_grad():
            for bucket in self.buckets:
                mine = bucket.layout.shard_of(bucket.params_full)
                if not bucket.master.aliased:
                    mine.copy_(bucket.master.param)  # cast to the compute dtype / copy from host
                if self.stage > 0:
                    handles.append(comm.all_gather_into(bucket.params_full, mine, self.axis, tag="param",
                                                        async_op=True))
        for handle in handles:
            handle.wait()

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if self.stage == 2:
                continue  # the first reduction of the next window overwrites the shard
            bucket.grads_full.zero_()
            for slot, view in zip(bucket.layout.slots, bucket.grad_views):
                if slot.param.grad is not view:
                    slot.param.grad = view
            if not (bucket.master.aliased and self.stage == 1):
                bucket.master.grad = None
        self._first_in_window = True

    # ---- checkpoint hooks ---------------------------------------------------------------------------
    def master_segments(self) -> list[tuple[torch.Tensor, list[MasterSegment]]]:
        return [(b.master.param, b.layout.master_segments()) for b in self.buckets]

    @property
    def masters_replicated(self) -> bool:
        return self.shards == 1

    def masters_loaded(self) -> None:
        self.zero_grad()
        self._publish_masters()

    # ---- introspection ----------------------------------------------------------------------------
    def padded_numel(self) -> int:
        """Ψ rounded up per bucket to a multiple of N: the elements every collective moves."""
        return sum(b.layout.padded for b in self.buckets)

    def shard_layout(self) -> list[dict]:
        return [b.layout.describe() for b in self.buckets]

    def memory_stats(self) -> dict[str, int]:
        masters = [b.master.param for b in self.buckets]
        master_grads = [b.master.grad for b in self.buckets if b.master.grad is not None]
        states = optimizer_state_tensors(self.optimizer) if self.optimizer else []
        params = tensor_bytes([b.params_full for b in self.buckets] + masters)
        grads = tensor_bytes([b.grads_full for b in self.buckets if b.grads_full is not None] + master_grads)
        optim = tensor_bytes(states)
        host = tensor_bytes(masters + master_grads + states) if self.placement.offload_optimizer else 0
        total = params + grads + optim
        return {"params": params, "grads": grads, "optimizer_state": optim, "total": total, "host": host,
                "device": total - host}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        gathered: dict[int, torch.Tensor] = {}
        for bucket in self.buckets:
            if bucket.master.aliased:
                full = bucket.params_full  # already the gathered fp32 masters
            elif self.stage == 0:
                full = bucket.master.param  # every rank holds the whole master
            else:
                full = torch.empty(bucket.layout.padded, dtype=torch.float32, device=self.placement.device)
                mine = bucket.master.param.detach().to(self.placement.device)
                comm.all_gather_into(full, mine, self.axis, tag="state_dict")
            for slot, view in zip(bucket.layout.slots, bucket.layout.views(full)):
                gathered[id(slot.param)] = view
        return state_with_gathered(self.module, gathered)


def _chunks(named: list[tuple[str, nn.Parameter]], cap: int):
    current, size = [], 0
    for name, p in named:
        if current and size + p.numel() > cap:
            yield current
            current, size = [], 0
        current.append((name, p))
        size += p.numel()
    if current:
        yield current

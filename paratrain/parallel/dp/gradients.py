"""How a stage keeps and reduces one bucket's gradients: the `BucketOperation`s of the reducer.

- `AllReduce` (stage 0) and `ReduceScatterInPlace` (stage 1) keep a full gradient buffer per bucket
  (`FullGradients`): every parameter's `.grad` is a view of it, so autograd accumulates straight into the
  memory that is reduced (no copy before the collective, one contiguous message per bucket) and gradients
  accumulate there over the micro-steps of a window.
- `StagedReduceScatter` (stage 2) keeps no full gradient between backwards: each fresh gradient is copied into
  the bucket's transient staging buffer (`StagedGradient`, shared with stage 3's units) and `.grad` dropped;
  the bucket is reduce-scattered on every backward and the reduced slice added into the fp32 gradient shard.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

import paratrain.comm as comm
from paratrain.layout.mesh import Axis
from paratrain.parallel.dp.flat import FlatLayout, MasterShard
from paratrain.parallel.dp.reducer import BucketOperation, GradBucket


class FullGradients(BucketOperation):
    """A flat gradient buffer per bucket whose views are the parameters' `.grad`.

    [Note: freed gradient buckets]
    With `free_between_steps` the buffers' storage is released after each update (`zero`) and `.grad` set to
    None, so no gradient memory exists during the next forward, when activations peak. A bucket is allocated
    again (zeroed) when the first gradient of it lands: autograd, finding `.grad` None, hands over the fresh
    gradient, and `gradient_ready` moves it into the new bucket and makes `.grad` the view again, the path
    that already serves a `.grad` someone replaced. The buffer tensors and their views live on (only the
    storage is resized), so the masters that alias a slice of a bucket (stage 1, fp32) stay valid.
    """

    def __init__(self, buckets: list[GradBucket], axis: Axis, pre_divide: float = 1.0,
                 free_between_steps: bool = False):
        self.axis = axis
        self.pre_divide = pre_divide
        self.free_between_steps = free_between_steps
        self.buffers = [torch.zeros(b.layout.padded, dtype=b.dtype, device=b.device) for b in buckets]
        self.views = [b.layout.views(buffer) for b, buffer in zip(buckets, self.buffers)]
        self.params = [[slot.param for slot in b.layout.slots] for b in buckets]
        for params, views in zip(self.params, self.views):  # allocated until the first update (views can be
            for param, view in zip(params, views):         # taken of them: stage 1's fp32 master gradient)
                param.grad = view

    def gradient_ready(self, bucket: GradBucket, index: int, param: nn.Parameter) -> None:
        view = self.views[bucket.index][index]
        if param.grad is not view:
            # .grad was None (freed buckets) or replaced (e.g. optimizer.zero_grad(set_to_none=True)): the new
            # tensor holds the whole accumulated gradient, so move it into the bucket and restore the view.
            self._allocate(bucket.index)
            view.copy_(param.grad)
            param.grad = view

    def _allocate(self, index: int) -> None:
        buffer = self.buffers[index]
        storage = buffer.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(buffer.numel() * buffer.element_size())
            buffer.zero_()

    def allocate(self) -> None:
        """Every bucket allocated (a bucket no gradient reached this window holds zeros)."""
        for index in range(len(self.buffers)):
            self._allocate(index)

    def launch(self, bucket: GradBucket) -> None:
        self._allocate(bucket.index)
        buffer = self.buffers[bucket.index]
        if self.pre_divide != 1.0:
            buffer.div_(self.pre_divide)
        bucket.handle = self._reduce(bucket, buffer)

    @abstractmethod
    def _reduce(self, bucket: GradBucket, buffer: torch.Tensor) -> comm.Handle:
        """Start the collective over the whole (pre-divided) bucket."""

    def complete(self, bucket: GradBucket) -> None:
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None

    def zero(self) -> None:
        """A new window: zero every bucket and make `.grad` the bucket views again, or free the buckets and
        set `.grad` to None (`free_between_steps`)."""
        for params, views, buffer in zip(self.params, self.views, self.buffers):
            if self.free_between_steps:
                for param in params:
                    param.grad = None
                buffer.untyped_storage().resize_(0)
                continue
            buffer.zero_()
            for param, view in zip(params, views):
                if param.grad is not view:
                    param.grad = view

    def tensors(self) -> list[torch.Tensor]:
        """The gradient memory this operation holds (for memory_stats; a freed bucket holds none)."""
        return list(self.buffers)


class AllReduce(FullGradients):
    """Stage 0: each bucket all-reduced in place; every rank holds the whole summed gradient."""

    def _reduce(self, bucket: GradBucket, buffer: torch.Tensor) -> comm.Handle:
        return comm.all_reduce(buffer, bucket.axis or self.axis, tag="grad", async_op=True)


class ReduceScatterInPlace(FullGradients):
    """Stage 1: each bucket reduce-scattered in place; this rank's slice of it then holds its summed gradient."""

    def _reduce(self, bucket: GradBucket, buffer: torch.Tensor) -> comm.Handle:
        return comm.reduce_scatter_into(bucket.layout.shard_of(buffer), buffer, bucket.axis or self.axis,
                                        tag="grad", async_op=True)


class StagedGradient:
    """One flat buffer's gradients until they are reduce-scattered into this rank's fp32 gradient shard.

    The staging buffer (compute dtype, the whole padded buffer) exists from the first gradient of a backward
    until its reduction is collected; the reduction writes straight into the fp32 shard on the first
    micro-step of a window when the dtypes and devices agree, else into a temporary that is added.
    """

    def __init__(self, layout: FlatLayout, master: MasterShard, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.master = master
        self.dtype = dtype
        self.device = device
        self.staging: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None
        self.first = True

    def _staging(self) -> torch.Tensor:
        if self.staging is None:
            self.staging = torch.zeros(self.layout.padded, dtype=self.dtype, device=self.device)
        return self.staging

    def add(self, index: int, grad: torch.Tensor, accumulate: bool = False) -> None:
        """Stage one parameter's gradient (ZeRO-2's buckets, as each arrives); `accumulate` adds it to what
        earlier backwards of the window staged."""
        slot = self.layout.slots[index]
        part = self._staging()[slot.offset:slot.offset + slot.numel]
        if accumulate:
            part.add_(grad.reshape(-1))
        else:
            part.copy_(grad.reshape(-1))

    def add_all(self, grads: list[torch.Tensor | None], accumulate: bool = False) -> None:
        """Stage every slot's gradient at once (None: zero): one `cat` into the buffer, whose slots are laid
        end to end (FSDP2 copies a group in with one `_chunk_cat`); `accumulate` adds to what earlier
        backwards of the window staged."""
        staging = self._staging()
        present = [g is not None for g in grads]
        if all(present):
            body = staging[:self.layout.numel]
            if accumulate:
                body.add_(torch.cat([g.reshape(-1) for g in grads]))
            else:
                torch.cat([g.reshape(-1) for g in grads], out=body)
            return
        for slot, grad in zip(self.layout.slots, grads):  # some unused: stage the others where they go
            part = staging[slot.offset:slot.offset + slot.numel]
            if grad is not None:
                part.add_(grad.reshape(-1)) if accumulate else part.copy_(grad.reshape(-1))
            elif not accumulate:
                part.zero_()

    def reduce(self, axis: Axis, first: bool, pre_divide: float = 1.0) -> comm.Handle:
        """Reduce-scatter the staged gradients (missing ones count as zero) toward the fp32 shard."""
        staging = self._staging()
        if pre_divide != 1.0:
            staging.div_(pre_divide)
        grad = self.master.ensure_grad()
        direct = first and grad.dtype == self.dtype and grad.device == staging.device
        self.reduced = grad if direct else torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self.first = first
        return comm.reduce_scatter_into(self.reduced, staging, axis, tag="grad", async_op=True)

    def collect(self) -> None:
        """After the reduction: add it into the fp32 shard and free the staging buffer."""
        self.master.accumulate(self.reduced, self.first)
        self.staging = self.reduced = None


class StagedReduceScatter(BucketOperation):
    """Stage 2: every backward stages each bucket's gradients and reduce-scatters them into the fp32 shard.

    With `accumulate` (zero_optimization.reduce_at_boundary) the staging buffers live through the window,
    each backward adds into them, and only the window's last backward reduce-scatters: 1/GA of the traffic
    for the unsharded gradients held during the window (FSDP2's set_requires_gradient_sync(False))."""

    def __init__(self, buckets: list[GradBucket], masters: list[MasterShard], axis: Axis, pre_divide: float = 1.0,
                 accumulate: bool = False):
        self.axis = axis
        self.pre_divide = pre_divide
        self.accumulate = accumulate
        self.reduces_every_backward = not accumulate
        self.staged = [StagedGradient(b.layout, m, b.dtype, b.device) for b, m in zip(buckets, masters)]
        self.first_in_window = True  # the window's first reduction overwrites the fp32 shard
        self._in_flight: GradBucket | None = None

    def gradient_ready(self, bucket: GradBucket, index: int, param: nn.Parameter) -> None:
        self.staged[bucket.index].add(index, param.grad, self.accumulate)
        param.grad = None

    def launch(self, bucket: GradBucket) -> None:
        # [Note: one reduction in flight] The previous bucket's reduction had this bucket's whole backward to
        # finish; collecting it now frees its staging buffer, so at most two buckets' full gradients exist
        # at once instead of the whole model's.
        if self._in_flight is not None:
            self.complete(self._in_flight)
        bucket.handle = self.staged[bucket.index].reduce(bucket.axis or self.axis, self.first_in_window,
                                                         self.pre_divide)
        self._in_flight = bucket

    def complete(self, bucket: GradBucket) -> None:
        if bucket.handle is None:
            return
        bucket.handle.wait()
        bucket.handle = None
        self.staged[bucket.index].collect()
        if self._in_flight is bucket:
            self._in_flight = None

    def finished(self) -> None:
        self.first_in_window = False

    def new_window(self) -> None:
        self.first_in_window = True

    def tensors(self) -> list[torch.Tensor]:
        """Staging buffers count only where they live through the window (accumulate): else transient."""
        return [s.staging for s in self.staged if s.staging is not None] if self.accumulate else []

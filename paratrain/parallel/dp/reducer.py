"""The bucketed gradient reducer that DDP and ZeRO stages 1-2 share: *when* each bucket is reduced.

Parameters are grouped into buckets (`plan_buckets`: reverse registration order, roughly the order backward
produces gradients, up to a size cap); each bucket is one `FlatLayout` whose gradients one collective reduces.
A post-accumulate-grad hook on every parameter hands its gradient to the stage's `BucketOperation` (which
keeps it where that stage keeps gradients) and, on a backward that communicates, marks it ready.

[Note: in-order launch]
A bucket is launched as soon as every parameter of it is ready, but strictly in index order: a complete
bucket waits for the ones before it. Backward produces gradients in an order that can differ between ranks
(threads, unused branches), and collectives on one group must be issued in the same order everywhere, so
only the index order is safe. `finish` launches whatever was not launched (a parameter without a gradient
counts as zero, or raises `UnusedParametersError`) and waits for every bucket.

What varies between the stages is *how* a bucket is reduced (`gradients.py`): an all-reduce of a full
gradient bucket (stage 0), an in-place reduce-scatter of it (stage 1), or a staging buffer reduce-scattered
into the fp32 gradient shard (stage 2), and whether every backward reduces (stage 2, which keeps no full
gradient to accumulate into) or only the last of an accumulation window.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

import paratrain.comm as comm
from paratrain.layout.mesh import Axis
from paratrain.parallel.dp.base import UnusedParametersError, weak_hook
from paratrain.parallel.dp.flat import FlatLayout

NamedParams = list[tuple[str, nn.Parameter]]


class GradBucket:
    """Parameters whose gradients one collective reduces, laid end to end (`layout`, padded to a multiple of
    its number of shards); gradients of the bucket have `dtype` and live on `device`."""

    def __init__(self, index: int, layout: FlatLayout, dtype: torch.dtype, device: torch.device,
                 axis: Axis | None = None):
        self.index = index
        self.axis = axis  # where its collectives run (None: the strategy's axis)
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.ready: set[int] = set()  # slots whose gradient has landed in a backward that communicates
        self.handle: comm.Handle | None = None  # its collective, while in flight


class BucketOperation(ABC):
    """How one stage keeps and reduces a bucket's gradients (the reducer decides when)."""

    reduces_every_backward = False
    """True: every backward reduces what it produced (and the reductions finish at the next backward or the
    step); False: gradients accumulate locally and only a backward that ends the window reduces."""

    @abstractmethod
    def gradient_ready(self, bucket: GradBucket, index: int, param: nn.Parameter) -> None:
        """`param.grad` (slot `index` of `bucket`) holds everything accumulated into it so far."""

    @abstractmethod
    def launch(self, bucket: GradBucket) -> None:
        """Start the bucket's collective (asynchronously; kept in `bucket.handle`)."""

    @abstractmethod
    def complete(self, bucket: GradBucket) -> None:
        """Wait for the bucket's collective (if in flight) and put its result where the stage keeps it."""

    def finished(self) -> None:  # noqa: B027 - an optional hook: most operations need nothing here
        """Every bucket of a backward (or window) is reduced."""


class BucketReducer:
    """Hooks every parameter of `buckets`, launches the buckets in order, and finishes them (see the note)."""

    def __init__(self, buckets: list[GradBucket], operation: BucketOperation, allow_unused: bool = False):
        self.buckets = buckets
        self.operation = operation
        self.allow_unused = allow_unused
        self._slot: dict[nn.Parameter, tuple[GradBucket, int]] = {}
        for bucket in buckets:
            for i, slot in enumerate(bucket.layout.slots):
                self._slot[slot.param] = (bucket, i)
                slot.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))
        self._communicate = False  # the running backward reduces
        self._pending = False  # a backward that reduces ran since the last finish
        self._force_no_sync = False
        self._next_launch = 0

    @contextmanager
    def no_sync(self):
        """Backwards inside accumulate locally and communicate nothing, even on a window's last one."""
        previous, self._force_no_sync = self._force_no_sync, True
        try:
            yield
        finally:
            self._force_no_sync = previous

    def begin_backward(self, sync: bool) -> None:
        """Called before each backward; `sync` is True when it ends a gradient-accumulation window."""
        every = self.operation.reduces_every_backward
        if every and self._pending:
            self.finish()  # the previous backward's reductions had the forward since to complete
        self._communicate = every or (sync and not self._force_no_sync)
        self._pending = self._pending or self._communicate

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket, index = self._slot[param]
        self.operation.gradient_ready(bucket, index, param)
        if self._communicate:
            bucket.ready.add(index)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.layout.slots):
                return
            self.operation.launch(bucket)
            self._next_launch += 1

    def finish(self) -> bool:
        """Launch every bucket not launched yet (in order) and complete them all; False (and nothing done)
        when no backward since the last finish communicated."""
        if not self._pending:
            return False
        rest = self.buckets[self._next_launch:]
        missing = [s.name for b in rest for i, s in enumerate(b.layout.slots) if i not in b.ready]
        if missing and not self.allow_unused:
            raise UnusedParametersError.naming(missing)
        for bucket in rest:
            self.operation.launch(bucket)  # unused parameters contribute their (zero or accumulated) gradient
        for bucket in self.buckets:
            self.operation.complete(bucket)
            bucket.ready.clear()
        self.operation.finished()
        self._next_launch = 0
        self._pending = self._communicate = False
        return True


def plan_buckets(named: NamedParams, cap: int, size_of: Callable[[nn.Parameter], int],
                 axis_of: Callable[[nn.Parameter], object] | None = None) -> list[NamedParams]:
    """`named` (already in bucket order) cut into consecutive runs of at most `cap` (measured by `size_of`),
    and wherever the dtype or the reduction axis (`axis_of`) changes; a parameter larger than `cap` gets a
    bucket of its own."""
    axis_of = axis_of or (lambda p: None)
    buckets: list[NamedParams] = []
    current: NamedParams = []
    size = 0
    for name, p in named:
        if current and (size + size_of(p) > cap or p.dtype != current[0][1].dtype
                        or axis_of(p) is not axis_of(current[0][1])):
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += size_of(p)
    if current:
        buckets.append(current)
    return buckets

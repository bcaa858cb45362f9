"""Thin, counted wrappers over torch.distributed collectives.

Every function takes the `Axis` (a named group from the mesh) explicitly; there is no default group.
On a size-1 axis the call is skipped entirely and not counted: nothing crosses a wire. Every launch goes
through `_launch` (point-to-point through `send_recv`), the single place that counts and, through the
axis' `CommGuard`, bounds every wait with `comm.timeout_s` and reports a hang.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from paratrain.comm.guard import CommGuard
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Handle:
    """An in-flight collective. `wait()` blocks until it is done (a no-op for skipped calls); with a
    `CommGuard` the wait is bounded by its timeout and a hang is reported (see `comm/guard.py`)."""

    def __init__(self, work=None, on_done: Callable[[], None] | None = None, describe: str = "",
                 guard: CommGuard | None = None, key: int | None = None):
        self._work = work
        self._on_done = on_done
        self._guard = guard
        self._key = key
        self.describe = describe

    def wait(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            if self._guard is not None:
                self._guard.wait(work, self._key)
            else:
                work.wait()
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done()

    def is_completed(self) -> bool:
        done = self._work is None or self._work.is_completed()
        if done and self._guard is not None:
            self._guard.end(self._key)
        return done

    def __del__(self) -> None:
        # A handle dropped without a wait is no longer anyone's wait: keep the in-flight table small.
        # (getattr: torch.compile can build instances without __init__ while it traces a hook.)
        guard = getattr(self, "_guard", None)
        if guard is not None:
            guard.end(self._key)


# axes (by their ranks) whose small sums and gathers go through a shared mapping while decoding on one host: filled
# and emptied by `paratrain.comm.host_reduce.host_collectives`
HOST_SLOTS: dict[tuple[int, ...], object] = {}


def _reduce_op(op: str):
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise InvalidValueError(f"unsupported reduce op {op!r}; use one of {sorted(_REDUCE_OPS)}") from None


def _launch(axis: Axis, op: str, tag: str, payload: torch.Tensor, call: Callable, async_op: bool,
            elements: int | None = None) -> Handle:
    elements = payload.numel() if elements is None else elements
    if axis.stats is not None:
        axis.stats.record(axis.name, op, elements, payload.element_size(), tag)
    describe = f"{op} on {axis.name} [{tag}] {elements} x {payload.dtype}"
    guard = axis.guard
    if guard is None:
        work = call(async_op)
        return Handle(work if async_op else None, describe=describe)
    # Guarded: always launched asynchronously, so that the wait (here, or the caller's) has a timeout.
    key = guard.begin(axis.name, op, tag, [payload], axis.ranks)
    handle = Handle(call(True), describe=describe, guard=guard, key=key)
    if not async_op:
        handle.wait()
    return handle


def all_reduce(tensor: torch.Tensor, axis: Axis, op: str = "sum", tag: str = "",
               async_op: bool = False) -> Handle:
    """In-place all-reduce of `tensor` over `axis`."""
    if axis.size == 1:
        return Handle()
    slots = HOST_SLOTS.get(axis.ranks) if HOST_SLOTS else None
    if slots is not None and op == "sum" and slots.fits(tensor):  # decoding on one host (comm/host_reduce.py)
        if axis.stats is not None:
            axis.stats.record(axis.name, "all_reduce", tensor.numel(), tensor.element_size(), tag)
        slots.all_reduce(tensor)
        return Handle()
    red = _reduce_op(op)
    return _launch(axis, "all_reduce", tag, tensor,
                   lambda a: dist.all_reduce(tensor, op=red, group=axis.group, async_op=a), async_op)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, axis: Axis, tag: str = "",
                    async_op: bool = False) -> Handle:
    """Concatenate every rank's equally sized `shard` (in axis order) into the flat `output`."""
    if axis.size == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard.view_as(output))
        return Handle()
    if output.numel() != shard.numel() * axis.size:
        raise InvalidValueError(f"all_gather on {axis.name}: output has {output.numel()} elements, expected "
                                f"{axis.size} x {shard.numel()}")
    return _launch(axis, "all_gather", tag, output,
                   lambda a: _all_gather_single(output, shard, group=axis.group, async_op=a), async_op)


def reduce_scatter_into(output: torch.Tensor, full: torch.Tensor, axis: Axis, op: str = "sum", tag: str = "",
                        async_op: bool = False) -> Handle:
    """Reduce `full` over `axis` and keep this rank's equal slice (in axis order) in `output`."""
    if axis.size == 1:
        if output.data_ptr() != full.data_ptr():
            output.copy_(full.view_as(output))
        return Handle()
    if full.numel() != output.numel() * axis.size:
        raise InvalidValueError(f"reduce_scatter on {axis.name}: input has {full.numel()} elements, expected "
                                f"{axis.size} x {output.numel()}")
    red = _reduce_op(op)
    return _launch(axis, "reduce_scatter", tag, full,
                   lambda a: _reduce_scatter_single(output, full, op=red, group=axis.group, async_op=a),
                   async_op)


def all_to_all_into(output: torch.Tensor, tensor: torch.Tensor, axis: Axis, tag: str = "",
                    async_op: bool = False) -> Handle:
    """Split `tensor` into `axis.size` equal chunks along dim 0 and send chunk j to rank j; `output` (the
    same shape) receives rank j's chunk for this rank at position j. Counted: the elements that leave this
    rank, (n - 1) / n of `tensor` (its own chunk stays)."""
    if axis.size == 1:
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor)
        return Handle()
    if tensor.shape[0] % axis.size or output.shape != tensor.shape:
        raise InvalidValueError(f"all_to_all on {axis.name}: dimension 0 of {tuple(tensor.shape)} must split into "
                                f"{axis.size} equal chunks and the output must have the input's shape, got "
                                f"{tuple(output.shape)}")
    leaving = tensor.numel() // axis.size * (axis.size - 1)
    return _launch(axis, "all_to_all", tag, tensor,
                   lambda a: dist.all_to_all_single(output, tensor, group=axis.group, async_op=a), async_op,
                   elements=leaving)


def all_to_all_rows(output: torch.Tensor, tensor: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int],
                    axis: Axis, tag: str = "") -> Handle:
    """Uneven all-to-all along dim 0: rows [sum(send_rows[:j]), +send_rows[j]) of `tensor` go to rank j, and
    `output` receives recv_rows[j] rows from rank j, in rank order. A count may be 0 (the rank still joins).
    Counted: the elements that leave this rank (every row but those it sends itself)."""
    if axis.size == 1:
        output.copy_(tensor)
        return Handle()
    if len(send_rows) != axis.size or len(recv_rows) != axis.size or sum(send_rows) != tensor.shape[0] \
            or sum(recv_rows) != output.shape[0]:
        raise InvalidValueError(f"all_to_all on {axis.name}: {axis.size} send and receive row counts must sum to "
                                f"the rows of input {tuple(tensor.shape)} and output {tuple(output.shape)}; got "
                                f"{list(send_rows)} and {list(recv_rows)}")
    row = math.prod(tensor.shape[1:])  # elements per row (the tensor may have no rows)
    leaving = (sum(send_rows) - send_rows[axis.rank]) * row
    return _launch(axis, "all_to_all", tag, tensor,
                   lambda a: dist.all_to_all_single(output, tensor, list(recv_rows), list(send_rows),
                                                    group=axis.group, async_op=a), False, elements=leaving)


def broadcast(tensor: torch.Tensor, axis: Axis, src: int = 0, tag: str = "", async_op: bool = False) -> Handle:
    """Broadcast from the rank with index `src` inside the axis."""
    if axis.size == 1:
        return Handle()
    root = axis.global_rank(src)
    return _launch(axis, "broadcast", tag, tensor,
                   lambda a: dist.broadcast(tensor, src=root, group=axis.group, async_op=a), async_op)


def all_gather_list(tensors_out: list[torch.Tensor], tensor: torch.Tensor, axis: Axis, tag: str = "") -> None:
    """all_gather into a list of tensors (shapes may differ per rank only if the caller pads)."""
    if axis.size == 1:
        tensors_out[0].copy_(tensor)
        return
    slots = HOST_SLOTS.get(axis.ranks) if HOST_SLOTS else None
    if slots is not None and slots.fits(tensor):  # decoding on one host (comm/host_reduce.py)
        if axis.stats is not None:
            axis.stats.record(axis.name, "all_gather", tensor.numel() * axis.size, tensor.element_size(), tag)
        slots.all_gather(tensors_out, tensor)
        return
    _launch(axis, "all_gather", tag, tensor,
            lambda a: dist.all_gather(tensors_out, tensor, group=axis.group, async_op=a), False,
            elements=tensor.numel() * axis.size)


def all_gather_object(obj, axis: Axis, tag: str = "") -> list:
    """Gather a picklable object from every rank of the axis (used for checks, never on the hot path)."""
    if axis.size == 1:
        return [obj]
    out = [None] * axis.size
    if axis.stats is not None:
        axis.stats.record(axis.name, "all_gather_object", 0, 1, tag)
    if axis.guard is None:
        dist.all_gather_object(out, obj, group=axis.group)
        return out
    # Blocking inside torch (no Work to wait on): bounded by the backend's own timeout, reported alike.
    key = axis.guard.begin(axis.name, "all_gather_object", tag, [], axis.ranks)
    axis.guard.run(lambda: dist.all_gather_object(out, obj, group=axis.group), key)
    return out


def send_recv(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
              axis: Axis, tag: str = "") -> list[Handle]:
    """Batched point-to-point: each pair is (tensor, peer index inside the axis). Returns handles."""
    ops, guarded = [], []
    for op, pairs, kind in (("send", sends, dist.isend), ("recv", recvs, dist.irecv)):
        for tensor, peer in pairs:
            if axis.stats is not None:
                axis.stats.record(axis.name, op, tensor.numel(), tensor.element_size(), tag)
            ops.append(dist.P2POp(kind, tensor, axis.global_rank(peer), group=axis.group))
            guarded.append((op, tensor, axis.global_rank(peer)))
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    describe = f"p2p on {axis.name} [{tag}]"
    if axis.guard is None:
        return [Handle(w, describe=describe) for w in works]
    if len(works) != len(guarded):  # coalesced into fewer works (NCCL): one record for the whole batch
        keys = [axis.guard.begin(axis.name, "send_recv", tag, [t for _, t, _ in guarded],
                                 tuple(sorted({p for _, _, p in guarded})))] * len(works)
    else:
        keys = [axis.guard.begin(axis.name, op, tag, [t], (peer,)) for op, t, peer in guarded]
    return [Handle(w, describe=describe, guard=axis.guard, key=k) for w, k in zip(works, keys)]


def barrier(axis: Axis) -> None:
    if axis.size == 1:
        return
    if axis.guard is None:
        dist.barrier(group=axis.group)
        return
    key = axis.guard.begin(axis.name, "barrier", "", [], axis.ranks)
    Handle(dist.barrier(group=axis.group, async_op=True), guard=axis.guard, key=key).wait()

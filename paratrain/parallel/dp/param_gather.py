"""ZeRO-1/2's all-gather of the updated parameters, overlapped with the next forward.

After the update every rank has written its master slice into its part of each parameter bucket; `launch`
starts every bucket's all-gather at once, asynchronously, in the order the forward needs them (the last bucket
first: buckets hold parameters in reverse registration order). With `overlap` nothing waits at the end of
the step: a forward pre-hook on each module that holds bucket parameters waits for that module's buckets
only, so the gathers of later layers run behind the forward of earlier ones. Without `overlap` the step
waits for every gather (the behaviour before the overlap existed).

[Note: the parameter-access guard]
Until its all-gather completes, a bucket holds the other ranks' slices from before the update, so nobody may
read a parameter before waiting. nn.Module reads its parameters only through its `_parameters` dict (attribute
access in forward, `parameters()`, `named_parameters()`, `state_dict()`, `load_state_dict()`, `.to()`), so
each module holding bucket parameters gets a `GuardedParameters` in its place: a dict that waits for that
module's buckets before handing a parameter out. Forward, eval, `module.state_dict()`, the engine's
`parameters()` / `named_parameters()` and any read through the module wait for exactly what they touch; the
strategy's own readers (`full_state_dict`, the checkpoint hooks, `memory_stats`, the next update) wait for
everything (`wait`). Only a reference to a parameter taken before the step and read after it, without going
through its module, bypasses the guard: `grad_sync.wait_for_params()` first. The forward pre-hooks make the
wait points explicit (a module may compute with its parameters without reading them through itself, and the
hook costs one check); the guard makes them complete. Pickled or deep-copied, the dict is a plain dict again.
"""

from __future__ import annotations

import torch
from torch import nn

import paratrain.comm as comm
from paratrain.layout.mesh import Axis
from paratrain.parallel.dp.reducer import GradBucket


class ParamGather:
    """The all-gathers of one strategy's parameter buckets, and where they are waited for."""

    def __init__(self, module: nn.Module, buckets: list[GradBucket], params_full: list[torch.Tensor], axis: Axis,
                 overlap: bool):
        self.buckets = buckets
        self.params_full = params_full  # per bucket: (padded,) compute dtype, the model's parameters are views
        self.axis = axis
        self.overlap = overlap
        self.pending: dict[int, comm.Handle] = {}  # bucket index -> its all-gather in flight
        if overlap:
            self._guard(module)

    def _guard(self, module: nn.Module) -> None:
        bucket_of = {slot.param: b.index for b in self.buckets for slot in b.layout.slots}
        for sub in module.modules():
            held = tuple(sorted({bucket_of[p] for p in sub._parameters.values() if p is not None and p in bucket_of}))
            if held:
                sub.register_forward_pre_hook(lambda m, args, held=held: self.wait(held) if self.pending else None)
                sub.__dict__["_parameters"] = GuardedParameters(sub._parameters, self, held)

    def launch(self) -> None:
        """All-gather every bucket (each rank has written its slice into it); wait at once unless overlapped."""
        for bucket in reversed(self.buckets):  # forward order
            full = self.params_full[bucket.index]
            self.pending[bucket.index] = comm.all_gather_into(full, bucket.layout.shard_of(full),
                                                              bucket.axis or self.axis, tag="param", async_op=True)
        if not self.overlap:
            self.wait()

    def wait(self, indices: tuple[int, ...] | None = None) -> None:
        """Wait for the all-gathers of `indices` (default: every bucket) that are still in flight."""
        for index in list(self.pending) if indices is None else indices:
            handle = self.pending.pop(index, None)
            if handle is not None:
                handle.wait()


class GuardedParameters(dict):
    """A module's `_parameters` that waits for the all-gathers of its buckets before handing a parameter out."""

    __slots__ = ("_gather", "_buckets")

    def __init__(self, params: dict, gather: ParamGather, buckets: tuple[int, ...]):
        super().__init__(params)
        self._gather = gather
        self._buckets = buckets

    def _wait(self) -> None:
        if self._gather.pending:
            self._gather.wait(self._buckets)

    def __getitem__(self, key):
        self._wait()
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._wait()
        return dict.get(self, key, default)

    def values(self):
        self._wait()
        return dict.values(self)

    def items(self):
        self._wait()
        return dict.items(self)

    def __reduce__(self):
        self._wait()
        return dict, (dict(self),)

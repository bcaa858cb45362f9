"""Distributed data parallel (ZeRO stage 0): full replicas, gradients all-reduced in overlapped buckets.

[Note: gradients live in buckets]
Every parameter's `.grad` is a view into a flat per-bucket buffer, so autograd accumulates straight into
the memory that is all-reduced: no copy before the collective and one contiguous message per bucket.
Buckets are filled in reverse registration order (roughly the order backward produces gradients). A
post-accumulate-grad hook marks a parameter ready; when every parameter of a bucket is ready on a
boundary micro-step, the bucket's all-reduce is launched asynchronously while backward continues. Buckets
launch strictly in index order so every rank issues the same collectives in the same order. The engine
waits once, before the optimizer step. Non-boundary micro-steps communicate nothing.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from paratrain import comm
from paratrain.data_parallel.base import (
    GradSync,
    MasterSegment,
    OptimizerFactory,
    model_parallel_weight,
    optimizer_state_tensors,
    tensor_bytes,
    weak_hook,
)
from paratrain.mesh import Mesh


class UnusedParametersError(RuntimeError):
    """Parameters that took part in no backward of a step (every data-parallel strategy raises this one)."""

    @classmethod
    def naming(cls, missing: list[str]) -> UnusedParametersError:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        return cls(f"{len(missing)} parameter(s) received no gradient in this step: {shown}. Either use them in "
                   f"the forward pass, freeze them (requires_grad=False), or set data_parallel."
                   f"allow_unused_parameters to true")


class _Bucket:
    def __init__(self, index: int, params: list[tuple[str, nn.Parameter]], dtype: torch.dtype):
        self.index = index
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for _, p in params), dtype=dtype, device=params[0][1].device)
        self.views: dict[nn.Parameter, torch.Tensor] = {}
        offset = 0
        for _, p in params:
            self.views[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready: set[int] = set()
        self.handle: comm.Handle | None = None


def broadcast_module_state(module: nn.Module, axis, src: int = 0, buffers: bool = True) -> None:
    """Make every rank's parameters (and buffers) equal to rank `src`'s: one flat broadcast per dtype."""
    tensors = list(module.parameters()) + (list(module.buffers()) if buffers else [])
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, axis, src=src, tag="init")
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class DistributedDataParallel(GradSync):
    def __init__(self, module: nn.Module, mesh: Mesh, bucket_cap_mb: float = 25.0,
                 allow_unused_parameters: bool = False, prescale: bool = False, predivide_factor: float = 1.0,
                 broadcast_state: bool = True, broadcast_buffers: bool = True):
        super().__init__(module, mesh)
        self.allow_unused = allow_unused_parameters
        world = self.axis.size
        self.pre_divide = float(world) if prescale else predivide_factor
        self.post_divide = world / self.pre_divide
        if broadcast_state:
            broadcast_module_state(module, self.axis, buffers=broadcast_buffers)
        self.buckets = self._make_buckets(int(bucket_cap_mb * 2**20))
        self._slot = {p: b for b in self.buckets for _, p in b.params}
        self._index = {p: i for i, (_, p) in enumerate(self.named_params)}
        for b in self.buckets:
            for _, p in b.params:
                p.grad = b.views[p]
                p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))
        self._sync = False
        self._force_no_sync = False
        self._next_launch = 0

    def _make_buckets(self, cap_bytes: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        current: list[tuple[str, nn.Parameter]] = []
        size = 0
        for name, p in reversed(self.named_params):
            if current and (size + p.numel() * p.element_size() > cap_bytes or p.dtype != current[0][1].dtype):
                buckets.append(_Bucket(len(buckets), current, current[0][1].dtype))
                current, size = [], 0
            current.append((name, p))
            size += p.numel() * p.element_size()
        if current:
            buckets.append(_Bucket(len(buckets), current, current[0][1].dtype))
        return buckets

    # ---- backward ---------------------------------------------------------------------------------
    def build_optimizer(self, factory: OptimizerFactory, param_groups: list | None = None) -> torch.optim.Optimizer:
        self.optimizer = factory(param_groups if param_groups is not None else [p for _, p in self.named_params])
        return self.optimizer

    @contextmanager
    def no_sync(self):
        previous, self._force_no_sync = self._force_no_sync, True
        try:
            yield
        finally:
            self._force_no_sync = previous

    def prepare_backward(self, sync: bool) -> None:
        self._sync = sync and not self._force_no_sync

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._slot[param]
        view = bucket.views[param]
        if param.grad is not view:
            # Someone replaced .grad (e.g. optimizer.zero_grad(set_to_none=True)): the new tensor holds the
            # whole accumulated gradient, so move it into the bucket and restore the view.
            view.copy_(param.grad)
            param.grad = view
        if not self._sync:
            return
        bucket.ready.add(self._index[param])
        self._launch_ready()

    def _launch(self, bucket: _Bucket) -> None:
        if self.pre_divide != 1.0:
            bucket.buffer.div_(self.pre_divide)
        bucket.handle = comm.all_reduce(bucket.buffer, self.axis, tag="grad", async_op=True)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def finish_gradients(self) -> None:
        if not self._sync:
            return
        missing = [name for b in self.buckets[self._next_launch:] for name, p in b.params
                   if self._index[p] not in b.ready]
        if missing and not self.allow_unused:
            raise UnusedParametersError.naming(missing)
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)  # unused parameters contribute their (zero or accumulated) gradient
        self._next_launch = len(self.buckets)
        for bucket in self.buckets:
            bucket.handle.wait()
            if self.post_divide != 1.0:
                bucket.buffer.div_(self.post_divide)
            bucket.handle = None
            bucket.ready.clear()
        self._next_launch = 0
        self._sync = False

    # ---- update -----------------------------------------------------------------------------------
    def local_grad_sq(self) -> torch.Tensor:
        device = self.buckets[0].buffer.device if self.buckets else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
        if self.mesh.size("tp") == 1:  # every parameter has weight 1: one reduction per bucket
            for b in self.buckets:
                total += b.buffer.float().pow(2).sum()
            return total
        for _, p in self.named_params:
            total += self._slot[p].views[p].float().pow(2).sum() * model_parallel_weight(p, self.mesh)
        return total

    def scale_gradients(self, factor: float) -> None:
        for b in self.buckets:
            b.buffer.mul_(factor)

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
        for b in self.buckets:
            for _, p in b.params:
                if p.grad is not b.views[p]:
                    p.grad = b.views[p]

    # ---- checkpoint hooks: the parameters are their own masters, identical on every dp rank ----------
    def master_segments(self) -> list[tuple[torch.Tensor, list[MasterSegment]]]:
        return [(p, [MasterSegment(name, 0, p.numel(), 0)]) for name, p in self.named_params]

    @property
    def masters_replicated(self) -> bool:
        return True

    def masters_loaded(self) -> None:
        self.zero_grad()

    def memory_stats(self) -> dict[str, int]:
        params = tensor_bytes(p for _, p in self.named_params)
        grads = tensor_bytes(b.buffer for b in self.buckets)
        optim = tensor_bytes(optimizer_state_tensors(self.optimizer)) if self.optimizer else 0
        total = params + grads + optim
        return {"params": params, "grads": grads, "optimizer_state": optim, "total": total, "host": 0,
                "device": total}

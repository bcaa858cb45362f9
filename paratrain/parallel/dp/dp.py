"""Single-process, multi-device data parallelism (the classic `nn.DataParallel`), on CPU or CUDA.

Each forward: the batch is split along `dim`; the module is replicated onto every device with its
parameters re-bound to differentiable copies of the primary's (`param.to(device)`, an identity on the
same device), the replicas run in parallel threads, and outputs are gathered on the output device. Because
each replica's parameters are autograd functions of the primary's, backward sums every replica's gradient
into the primary parameters: there is no separate all-reduce, which is why DP is simple and why it does
not scale past one machine (one Python process drives every device).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_structure, tree_unflatten

from paratrain.errors import InvalidValueError, RunError


def _scatter(value, devices: list[torch.device], dim: int):
    """Split tensors along `dim` into len(devices) chunks (moved to each device); replicate the rest.
    Returns one structure like `value` per device (None where a tensor had fewer chunks than devices)."""
    leaves, spec = tree_flatten(value)
    per_leaf = [_scatter_leaf(leaf, devices, dim) for leaf in leaves]
    return [tree_unflatten([parts[i] for parts in per_leaf], spec) for i in range(len(devices))]


def _scatter_leaf(leaf, devices: list[torch.device], dim: int) -> list:
    if not isinstance(leaf, torch.Tensor):
        return [leaf] * len(devices)
    chunks = torch.chunk(leaf, len(devices), dim=dim)
    return [c.to(d) for c, d in zip(chunks, devices)] + [None] * (len(devices) - len(chunks))


def _gather(outputs: list, device: torch.device, dim: int):
    """One structure like each replica's output: tensors concatenated along `dim` (scalars stacked) on
    `device`, anything else as the list of the replicas' values."""
    spec = tree_structure(outputs[0])
    per_output = [tree_leaves(o) for o in outputs]
    return tree_unflatten([_gather_leaf(list(values), device, dim) for values in zip(*per_output)], spec)


def _gather_leaf(values: list, device: torch.device, dim: int):
    if not isinstance(values[0], torch.Tensor):
        return values
    moved = [v.to(device) for v in values]
    return torch.stack(moved) if values[0].dim() == 0 else torch.cat(moved, dim=dim)


def _has_empty(value) -> bool:
    return any(leaf is None for leaf in tree_leaves(value))


class DataParallel(nn.Module):
    """`DataParallel(module, devices=["cpu", "cpu"])`: run `module` on every device, gradients on the primary.

    `module` must live on `devices[0]`. Outputs are gathered on `output_device` (default `devices[0]`):
    tensors are concatenated along `dim`, scalars (e.g. per-replica losses) are stacked.
    """

    def __init__(self, module: nn.Module, devices: Sequence[str | int | torch.device] | None = None,
                 output_device: str | int | torch.device | None = None, dim: int = 0):
        super().__init__()
        if devices is None:
            count = torch.cuda.device_count()
            devices = [f"cuda:{i}" for i in range(count)] if count else ["cpu", "cpu"]
        self.devices = [torch.device(f"cuda:{d}" if isinstance(d, int) else d) for d in devices]
        if not self.devices:
            raise InvalidValueError("DataParallel needs at least one device")
        self.module = module
        self.output_device = torch.device(output_device) if output_device is not None else self.devices[0]
        self.dim = dim
        # Replicas are structural copies made once; their parameters are re-bound every forward.
        self._replicas = [copy.deepcopy(module).to(d) for d in self.devices[1:]]
        for r in self._replicas:
            r.requires_grad_(False)

    def _bind(self, replica: nn.Module, device: torch.device) -> nn.Module:
        primary = dict(self.module.named_modules())
        for name, sub in replica.named_modules():
            source = primary[name]
            for key, param in source._parameters.items():
                if param is not None:
                    sub._parameters[key] = param.to(device)  # differentiable: grads flow to the primary
            for key, buf in source._buffers.items():
                if buf is not None:
                    sub._buffers[key] = buf.detach().to(device, copy=True)
        replica.train(self.module.training)
        return replica

    def forward(self, *inputs, **kwargs):
        scattered = _scatter((inputs, kwargs), self.devices, self.dim)
        work = [(i, s) for i, s in enumerate(scattered) if not _has_empty(s)]
        if len(work) == 1:
            args, kw = work[0][1]
            return _gather([self.module(*args, **kw)], self.output_device, self.dim)
        replicas = [self.module] + [self._bind(r, d) for r, d in zip(self._replicas, self.devices[1:])]
        results: dict[int, object] = {}
        grad_enabled = torch.is_grad_enabled()  # grad mode is thread-local: carry the caller's

        def run(i: int, args, kw) -> None:
            try:
                with torch.set_grad_enabled(grad_enabled):
                    results[i] = replicas[i](*args, **kw)
            except BaseException as exc:  # re-raised in the caller's thread below
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i, a, k)) for i, (a, k) in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outputs = []
        for i, _ in work:
            if isinstance(results[i], BaseException):
                raise RunError(f"DataParallel replica {i} on {self.devices[i]} failed") from results[i]
            outputs.append(results[i])
        return _gather(outputs, self.output_device, self.dim)

"""Count host reads of tensor values: the CPU stand-in for CUDA's sync debug mode
(`torch.cuda.set_sync_debug_mode`), which only exists on an accelerator.

    with HostSyncs() as syncs:
        engine.train_batch(data)
    assert syncs.total == 0, syncs.sites

Every way Python reads a tensor's value is patched: the methods of `torch.Tensor` that hand a value to Python
(`item`, `tolist`, `numpy`, `cpu`, `__float__`, `__int__`, `__bool__`, `__index__`; `__format__` and `in` reach
`item`), and the functions, free or methods, that read values inside torch's C++ before they return (`VALUE_READS`:
`torch.equal` and `allclose` answer a Python bool; `nonzero`, `argwhere`, `masked_select` and `unique` make a
tensor whose shape depends on the values). On an accelerator each one waits for the device. Each call is counted
at the innermost paratrain frame that made it (file:line function), so a failure names the line.

Reads the library makes on purpose from host memory (the loader's tensors, before they are copied to the device:
`paratrain.data.host.host_reads`) are counted apart, in `host_sites`: they cost no device sync. Not thread-safe:
count on the thread that trains.
"""

from __future__ import annotations

import collections
import sys

import torch

from paratrain.data.host import reading_host_memory

READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")
# Functions whose result is computed from the values before they return: torch.<name> and Tensor.<name> where both
# exist. (Boolean-mask indexing, bincount and repeat_interleave without output_size read too on an accelerator;
# not counted yet, see docs/architecture.md.)
VALUE_READS = ("equal", "allclose", "is_nonzero", "nonzero", "argwhere", "masked_select", "unique",
               "unique_consecutive")


class HostSyncs:
    def __init__(self, package: str = "paratrain"):
        self.package = package
        self.sites: collections.Counter[str] = collections.Counter()  # reads that wait for the device
        self.host_sites: collections.Counter[str] = collections.Counter()  # reads of host memory (the loader's)
        self._saved: list[tuple[object, str, object]] = []
        self._depth = 0

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def _site(self, read: str) -> str:
        frame, fallback = sys._getframe(2), None
        while frame is not None:
            name = frame.f_code.co_filename
            if fallback is None and "/torch/" not in name:  # outside paratrain: the caller of torch's code
                fallback = frame
            if f"/{self.package}/" in name and not name.endswith("host_syncs.py"):
                break
            frame = frame.f_back
        frame = frame or fallback
        path = frame.f_code.co_filename.rsplit(f"/{self.package}/", 1)[-1]
        return f"{read} at {self.package}/{path}:{frame.f_lineno} {frame.f_code.co_name}"

    def _counted(self, read: str, original):
        def counted(*args, **kwargs):
            if self._depth:  # a read inside a counted one (Tensor.unique calls torch.unique): counted once
                return original(*args, **kwargs)
            (self.host_sites if reading_host_memory() else self.sites)[self._site(read)] += 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _patch(self, owner, name: str, read: str) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, self._counted(read, original))

    def __enter__(self) -> HostSyncs:
        for read in READS:
            self._patch(torch.Tensor, read, read)
        for read in VALUE_READS:
            if hasattr(torch, read):
                self._patch(torch, read, f"torch.{read}")
            if hasattr(torch.Tensor, read):
                self._patch(torch.Tensor, read, read)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

"""Count host reads of tensor values: the CPU stand-in for CUDA's sync debug mode
(`torch.cuda.set_sync_debug_mode`), which only exists on an accelerator.

    with HostSyncs() as syncs:
        engine.train_batch(data)
    assert syncs.total == 0, syncs.sites

Every way Python reads a tensor's value is patched on `torch.Tensor` (`item`, `tolist`, `numpy`, `cpu`,
`__float__`, `__int__`, `__bool__`, `__index__`); on an accelerator each one waits for the device. Each call is
counted at the innermost paratrain frame that made it (file:line function), so a failure names the line.
Calls torch makes inside its own C++ code are not seen (they are not Python reads). Not thread-safe: count on
the thread that trains.
"""

from __future__ import annotations

import collections
import sys

import torch

READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")


class HostSyncs:
    def __init__(self, package: str = "paratrain"):
        self.package = package
        self.sites: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, object] = {}

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def _site(self, read: str) -> str:
        frame, fallback = sys._getframe(2), None
        while frame is not None:
            name = frame.f_code.co_filename
            if fallback is None:
                fallback = frame
            if f"/{self.package}/" in name and not name.endswith("host_syncs.py"):
                break
            frame = frame.f_back
        frame = frame or fallback
        path = frame.f_code.co_filename.rsplit(f"/{self.package}/", 1)[-1]
        return f"{read} at {self.package}/{path}:{frame.f_lineno} {frame.f_code.co_name}"

    def _counted(self, read: str, original):
        def counted(tensor, *args, **kwargs):
            self.sites[self._site(read)] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def __enter__(self) -> HostSyncs:
        for read in READS:
            self._saved[read] = getattr(torch.Tensor, read)
            setattr(torch.Tensor, read, self._counted(read, self._saved[read]))
        return self

    def __exit__(self, *exc) -> None:
        for read, original in self._saved.items():
            setattr(torch.Tensor, read, original)
        self._saved.clear()

"""Reads of host memory, declared: the data path reads the loader's tensors (token ids, masks, positions, still in
host memory before the engine copies them to the device) to check them and to learn their document structure.
Such a read waits for nothing on an accelerator; `paratrain.testing.HostSyncs` counts it apart from the reads that
would wait for the device.

    if on_host(ids, mask):
        with host_reads():
            ...  # reads of these tensors only
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_STATE = threading.local()


def on_host(*tensors: torch.Tensor | None) -> bool:
    """Whether every given tensor lives in host memory (the CPU), so reading it costs no device sync."""
    return all(t is None or t.device.type == "cpu" for t in tensors)


@contextmanager
def host_reads():
    """Declare that the reads inside are of host memory (the caller checked `on_host` for what it reads)."""
    depth = getattr(_STATE, "depth", 0)
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth


def reading_host_memory() -> bool:
    return getattr(_STATE, "depth", 0) > 0

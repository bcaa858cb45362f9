"""Counting what autograd keeps for backward (activation memory, measured rather than estimated)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def saved_activation_bytes(run: Callable[[], object], params: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while `run()` executes, parameters excluded.

    Storages are counted once however many saved tensors view them, so a tensor kept by two operations (or
    a view of a kept tensor) is not counted twice; parameters are what the model holds anyway."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())

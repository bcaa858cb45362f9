"""Nested structures of tensors (tuples, lists, dicts, dataclasses, with other values mixed in), walked by
torch.utils._pytree: containers keep their types, everything that is not a tensor passes through."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map_only


def to_device(value, device: torch.device):
    """`value` with every tensor moved to `device` (asynchronously where the copy allows it)."""
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), value)


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in `value`, in order."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]

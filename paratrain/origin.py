"""Where a rank's local tensor comes from in the original (unsplit) model: the checkpoint's coordinates.

After `parallelize` a rank holds a local module whose tensors may be renamed (a pipeline stage), sliced
(tensor parallelism) or copies of tensors other ranks hold too (replicated over tp). An `Origin` says, for
one local tensor, which tensor of the original model it is and which box of it the rank holds:

    full[offsets[0] : offsets[0] + local_shape[0], offsets[1] : ...]

Each model-parallel step of `parallelize` contributes a function `Origin -> Origin` that undoes what it did
(TP: the slice of a split dimension; PP: the stage's names), so a checkpoint can store every tensor
in layout-independent form and any other layout can find what it needs. Data-parallel sharding is the
strategy's business and is described separately, as flat ranges of these boxes (`GradSync.master_segments`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Origin:
    name: str  # the original model's state-dict name
    shape: tuple[int, ...]  # the original tensor's full shape
    offsets: tuple[int, ...]  # the local tensor's first element, in full-tensor coordinates
    local_shape: tuple[int, ...]  # the box this rank holds; may reach past `shape` where a split dimension
    #                               was padded (an uneven vocabulary): those elements are padding
    replicated: tuple[str, ...] = ()  # model-parallel mesh axes on which every rank holds this same box

    @classmethod
    def local(cls, name: str, tensor: torch.Tensor) -> Origin:
        """The identity: a local tensor that is the whole original tensor (before any step is undone)."""
        shape = tuple(tensor.shape)
        return cls(name, shape, (0,) * len(shape), shape)

    def renamed(self, name: str) -> Origin:
        return replace(self, name=name)

    def split(self, dim: int, full_size: int, index: int) -> Origin:
        """This box is part `index` of equal slices of dimension `dim`, whose full size is `full_size`."""
        shape, offsets = list(self.shape), list(self.offsets)
        shape[dim] = full_size
        offsets[dim] += index * self.local_shape[dim]
        return replace(self, shape=tuple(shape), offsets=tuple(offsets))

    def replicated_over(self, axis: str) -> Origin:
        return replace(self, replicated=(*self.replicated, axis))

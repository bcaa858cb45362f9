"""Where a rank's local tensor comes from in the original (unsplit) model: the checkpoint's coordinates.

After `parallelize` a rank holds a local module whose tensors may be renamed (a pipeline stage), sliced
(tensor parallelism) or copies of tensors other ranks hold too (replicated over tp). An `Origin` says, for
one local tensor, which tensor of the original model it is and which box of it the rank holds:

    full[offsets[0] : offsets[0] + local_shape[0], offsets[1] : ...]

Each step of `parallelize` knows how to undo what it did, `step.origin(Origin) -> Origin` (TP: the slice of a
split dimension, read from the tensor's placement; PP: the names the stage module gave the layers), and the
steps are undone last first, so each sees the coordinates it produced. A checkpoint therefore stores every
tensor in layout-independent form and any other layout finds what it needs. Data-parallel sharding is the
strategy's business and is described separately, as flat ranges of these boxes (`GradSync.master_segments`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from paratrain.layout.placement import Placement


@dataclass(frozen=True)
class Origin:
    name: str  # the original model's state-dict name
    shape: tuple[int, ...]  # the original tensor's full shape
    offsets: tuple[int, ...]  # the local tensor's first element, in full-tensor coordinates
    local_shape: tuple[int, ...]  # the box this rank holds; may reach past `shape` where a split dimension
    #                               was padded (an uneven vocabulary): those elements are padding
    replicated: tuple[str, ...] = ()  # model-parallel mesh axes on which every rank holds this same box
    placement: Placement = Placement()  # the local tensor's placement records (what the steps read)

    @classmethod
    def local(cls, name: str, tensor: torch.Tensor, placement: Placement | None = None) -> Origin:
        """The identity: a local tensor that is the whole original tensor (before any step is undone), with
        the records the parallel model keeps for it."""
        shape = tuple(tensor.shape)
        return cls(name, shape, (0,) * len(shape), shape, placement=placement or Placement())

    def renamed(self, name: str) -> Origin:
        return replace(self, name=name)

    def split(self, dim: int, full_size: int, index: int) -> Origin:
        """This box is part `index` of equal slices of dimension `dim`, whose full size is `full_size`."""
        shape, offsets = list(self.shape), list(self.offsets)
        shape[dim] = full_size
        offsets[dim] += index * self.local_shape[dim]
        return replace(self, shape=tuple(shape), offsets=tuple(offsets))

    def within(self, dim: int, offset: int, whole: int) -> Origin:
        """This box (of a part) sits at `offset` along `dim` of a tensor `whole` long there (a packed one)."""
        shape, offsets = list(self.shape), list(self.offsets)
        shape[dim] = whole
        offsets[dim] += offset
        return replace(self, shape=tuple(shape), offsets=tuple(offsets))

    def replicated_over(self, axis: str) -> Origin:
        return replace(self, replicated=(*self.replicated, axis))


class Step:
    """One step of `parallelize` (tensor parallel, pipeline split, context parallel, ...), as what it did to
    the model and how to undo it for one tensor's coordinates. A step that renames or splits nothing keeps
    the defaults. `ParallelModel` keeps the steps in the order they were applied and undoes them last first.
    """

    name = "step"
    relabels = False  # True: the step only gives the model's tensors other names and changes nothing in it

    def origin(self, found: Origin) -> Origin:
        """Coordinates after this step -> coordinates before it (no communication)."""
        return found

    def forward_name(self, name: str) -> str:
        """A tensor's name before this step -> its name after it (the inverse of `origin`'s renaming)."""
        return name

    def explain(self, name: str) -> str | None:
        """What this step did with the tensor `name` (in the coordinates the step received), for errors."""
        return None

    def note(self) -> str:
        """One line for the log: what the step did."""
        return self.name


class Renamed(Step):
    """The model's own names -> the names it is known by (a PipelineModule's `layer_names`)."""

    name = "names"
    relabels = True

    def __init__(self, to_original: dict[str, str]):
        self.to_original = to_original
        self.from_original = {v: k for k, v in to_original.items()}

    def origin(self, found: Origin) -> Origin:
        return found.renamed(self.to_original.get(found.name, found.name))

    def forward_name(self, name: str) -> str:
        return self.from_original.get(name, name)

    def explain(self, name: str) -> str | None:
        own = self.from_original.get(name)
        return None if own is None else f"the PipelineModule's layer_names call its tensor '{own}' '{name}'"

    def note(self) -> str:
        return f"layer names: {len(self.to_original)} tensors known by the model's layer_names"

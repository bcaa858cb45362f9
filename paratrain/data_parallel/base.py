"""The contract between the engine and a data-parallel strategy (DDP, ZeRO-1/2, ZeRO-3).

The engine never looks inside a strategy: it tells it when a backward is about to run (and whether it
ends a gradient-accumulation window), asks it to finish gradient reduction, for the global gradient norm,
to scale gradients (clipping), to step, and to zero gradients. Each strategy owns where gradients and
optimizer states live, which is the whole difference between DDP and the ZeRO stages.
"""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from paratrain import comm
from paratrain.mesh import Axis, Mesh

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def weak_hook(method):
    """`method` (bound) as a tensor hook that does not keep its object alive.

    [Note: why weak] A parameter's hooks live in a dict the garbage collector cannot see through, so a
    bound method there makes the cycle parameter -> hook -> strategy -> parameter unbreakable: every engine
    built in a process would live on with its buffers and process groups (whose threads keep waking). With
    a weak reference the strategy dies with its engine; a hook that outlives it does nothing.
    """
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer are counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # Scalar step counters are bookkeeping, not model state; the formulas count the moments only.
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


def model_parallel_weight(param: nn.Parameter, mesh: Mesh) -> float:
    """How much of this parameter's squared gradient norm a rank contributes to the global norm.

    A parameter sharded over tp contributes fully (the shards are disjoint); one replicated over tp is
    present on every tp rank with the same gradient (sequence parallelism sums the gradients of norms that
    saw different tokens before they land), so each contributes 1/tp and the sum over tp counts it once.
    Pipeline stages hold disjoint parameters, so pp needs no weight. Over dp x cp every rank holds the same
    averaged gradient, so nothing is summed there, except by strategies whose ranks hold disjoint slices
    (ZeRO), which add their slices over dp x cp first.
    """
    tp = mesh.size("tp")
    return 1.0 if tp == 1 or getattr(param, "tp_sharded", False) else 1.0 / tp


def sum_over_model_parallel(local_sq: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Sum squared-norm contributions over the pp x tp ranks that hold different parameters."""
    comm.all_reduce(local_sq, mesh.axis(("pp", "tp")), tag="grad_norm")
    return local_sq


@dataclass(frozen=True)
class MasterSegment:
    """Part of a local parameter held in one of the optimizer's tensors (a master): elements [start, end) of
    the flattened parameter are elements [offset, offset + end - start) of the flattened master."""

    name: str  # the parameter's name in the local module
    start: int
    end: int
    offset: int


class GradSync(ABC):
    """A data-parallel strategy: owns gradient reduction, optimizer placement and the update."""

    def __init__(self, module: nn.Module, mesh: Mesh):
        self.module = module
        self.mesh = mesh
        # Gradients are averaged over every rank that saw different data: dp, and cp (other tokens).
        self.axis: Axis = mesh.axis(("dp", "cp"))
        self.optimizer: torch.optim.Optimizer | None = None
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    # ---- lifecycle -------------------------------------------------------------------------------
    @abstractmethod
    def build_optimizer(self, factory: OptimizerFactory, param_groups: list | None = None) -> torch.optim.Optimizer:
        """Create the optimizer over whatever this strategy updates (full params, or this rank's shard)."""

    @abstractmethod
    def prepare_backward(self, sync: bool) -> None:
        """Called before each backward; `sync` is True when it ends a gradient-accumulation window."""

    @abstractmethod
    def finish_gradients(self) -> None:
        """After the last backward of a window: complete every reduction; gradients are then averaged."""

    @abstractmethod
    def local_grad_sq(self) -> torch.Tensor:
        """This rank's contribution to the global squared gradient norm (a float32 scalar tensor)."""

    @abstractmethod
    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient this rank holds by `factor` (clipping, loss-scale removal)."""

    @abstractmethod
    def optimizer_step(self) -> None:
        """Apply the update to the model's parameters (and re-assemble them if they are sharded)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Start a new accumulation window."""

    @abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds: params, grads, optimizer_state, total, and how much of it is on the host
        (offloaded) vs the device."""

    # ---- checkpoint hooks (paratrain/checkpoint reads and writes through these only) --------------
    @abstractmethod
    def master_segments(self) -> list[tuple[torch.Tensor, list[MasterSegment]]]:
        """Every tensor the optimizer updates (its key in `optimizer.state`) with the parameter ranges it
        holds. Masters are fp32 (or the model's dtype where the model is its own master); a range of a
        master and the same range of each of its tensor optimizer states belong to the same parameter."""

    @property
    @abstractmethod
    def masters_replicated(self) -> bool:
        """True when every rank of `self.axis` holds the same masters (DDP, unsharded stage 0)."""

    @abstractmethod
    def masters_loaded(self) -> None:
        """The masters were overwritten (a checkpoint was loaded): make the model's parameters equal to
        them (collective over `self.axis` where parameters are gathered) and start a new window."""

    # ---- shared behaviour ------------------------------------------------------------------------
    def global_grad_norm(self) -> float:
        """The L2 norm of the full gradient, identical to what one process would compute."""
        local = self.local_grad_sq()
        return math.sqrt(float(sum_over_model_parallel(local, self.mesh)))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters and buffers under their original names (a copy, on every rank)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def has_overflow(self) -> bool:
        """True if any gradient on any rank of the dp axis is inf/nan (used by fp16 loss scaling)."""
        local = self.local_grad_sq()
        flag = (~torch.isfinite(local)).float().reshape(1)  # on the gradients' device: no host round trip
        comm.all_reduce(flag, self.mesh.axis(("dp", "cp")), op="max", tag="overflow")
        comm.all_reduce(flag, self.mesh.axis(("pp", "tp")), op="max", tag="overflow")
        return bool(flag.item() > 0)
